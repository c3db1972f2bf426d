#!/usr/bin/env bash
# Build the LeaderWorkerSet controller (sigs.k8s.io/lws, its cmd/ package) from
# the Go module proxy and copy its CRDs out of the same module, into a cache
# keyed by version, outside the repo. A warm cache returns in milliseconds.
#
#   e2e/lws/build.sh   -> prints two lines:
#                           the path of the lws-controller binary
#                           the directory holding the CRD YAML (apply it with
#                           kubectl apply --server-side: it is too big for the
#                           last-applied annotation)
#
# Prebuilt: set FERRY_LWS_ASSETS to a directory laid out like the cache
# (bin/lws-controller, crd/*.yaml); nothing is built then.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

ready() {  # dir
  [[ -x "$1/bin/lws-controller" ]] && compgen -G "$1/crd/*.yaml" >/dev/null
}

if [[ -n "${FERRY_LWS_ASSETS:-}" ]]; then
  ready "$FERRY_LWS_ASSETS" || { echo "build.sh: $FERRY_LWS_ASSETS lacks bin/lws-controller or crd/*.yaml (FERRY_LWS_ASSETS)" >&2; exit 1; }
  echo "$FERRY_LWS_ASSETS/bin/lws-controller"; echo "$FERRY_LWS_ASSETS/crd"; exit 0
fi

cache=${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}
root="$cache/lws/${LWS_VERSION}"
if ready "$root"; then echo "$root/bin/lws-controller"; echo "$root/crd"; exit 0; fi

command -v go >/dev/null || { echo "build.sh: Go is needed to build the LWS controller (or set FERRY_LWS_ASSETS)" >&2; exit 1; }
src="$root/src"
mkdir -p "$root/bin"
# shellcheck source=../gomod.sh
source "$here/../gomod.sh"
log() { echo "[lws] $*" >&2; }
moddir=$(gomod_require "$src" ferry.dev/lws sigs.k8s.io/lws "$LWS_VERSION")

# The CRDs, from the same module zip the binary is built from.
if ! compgen -G "$root/crd/*.yaml" >/dev/null; then
  rm -rf "$root/crd.tmp" && mkdir -p "$root/crd.tmp"
  cp "$moddir"/config/crd/bases/*.yaml "$root/crd.tmp/"
  chmod u+w "$root"/crd.tmp/*.yaml  # the module cache is read-only
  rm -rf "$root/crd" && mv "$root/crd.tmp" "$root/crd"
fi

if [[ ! -x "$root/bin/lws-controller" ]]; then
  log "building lws-controller ${LWS_VERSION}"
  pkg=sigs.k8s.io/lws/pkg/version
  gomod_build "$src" "$root/bin/lws-controller" sigs.k8s.io/lws/cmd \
    -ldflags "-s -w -X ${pkg}.GitVersion=${LWS_VERSION} -X ${pkg}.GitCommit=module-proxy -X ${pkg}.BuildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
fi
echo "$root/bin/lws-controller"
echo "$root/crd"
