#!/usr/bin/env bash
# Build CoreDNS (github.com/coredns/coredns, its module root is the main
# package, with the default plugin set of core/plugin/zplugin.go, kubernetes
# included) from the Go module proxy into a cache keyed by version, outside the
# repo. A warm cache returns in milliseconds.
#
#   e2e/coredns/build.sh            -> prints the path of the coredns binary
#                                      (last stdout line)
#
# Prebuilt binary: set FERRY_COREDNS to its path; nothing is built then.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

if [[ -n "${FERRY_COREDNS:-}" ]]; then
  [[ -x "$FERRY_COREDNS" ]] || { echo "build.sh: $FERRY_COREDNS is not executable (FERRY_COREDNS)" >&2; exit 1; }
  echo "$FERRY_COREDNS"; exit 0
fi

cache=${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}
root="$cache/coredns/${COREDNS_VERSION}"
if [[ -x "$root/bin/coredns" ]]; then echo "$root/bin/coredns"; exit 0; fi

command -v go >/dev/null || { echo "build.sh: Go is needed to build CoreDNS (or set FERRY_COREDNS)" >&2; exit 1; }
# shellcheck source=../gomod.sh
source "$here/../gomod.sh"
echo "[coredns] building coredns ${COREDNS_VERSION}" >&2
gomod_require "$root/src" ferry.dev/coredns github.com/coredns/coredns "$COREDNS_VERSION" >/dev/null
mkdir -p "$root/bin"
gomod_build "$root/src" "$root/bin/coredns" github.com/coredns/coredns \
  -ldflags "-s -w -X github.com/coredns/coredns/coremain.GitCommit=module-proxy"
echo "$root/bin/coredns"
