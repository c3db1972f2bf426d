#!/usr/bin/env bash
# Build rancher's local-path-provisioner (the dynamic provisioner kind uses)
# from the Go module proxy into a cache keyed by version, outside the repo.
# A warm cache returns in milliseconds.
#
#   e2e/storage/build.sh            -> prints the path of the binary
#
# Prebuilt binary: set FERRY_LOCAL_PATH_PROVISIONER to its path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

if [[ -n "${FERRY_LOCAL_PATH_PROVISIONER:-}" ]]; then
  [[ -x "$FERRY_LOCAL_PATH_PROVISIONER" ]] || { echo "build.sh: $FERRY_LOCAL_PATH_PROVISIONER is not executable" >&2; exit 1; }
  echo "$FERRY_LOCAL_PATH_PROVISIONER"; exit 0
fi

cache=${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}
bin="$cache/local-path-provisioner/${LOCAL_PATH_PROVISIONER_VERSION}/bin"
if [[ -x "$bin/local-path-provisioner" ]]; then echo "$bin/local-path-provisioner"; exit 0; fi

command -v go >/dev/null || { echo "build.sh: Go is needed to build local-path-provisioner (or set FERRY_LOCAL_PATH_PROVISIONER)" >&2; exit 1; }
mkdir -p "$bin"
echo "[storage] building local-path-provisioner ${LOCAL_PATH_PROVISIONER_VERSION}" >&2
gobin=$(mktemp -d)
trap 'rm -rf "$gobin"' EXIT
GOBIN="$gobin" CGO_ENABLED=0 GOFLAGS=-mod=mod go install -ldflags "-s -w" \
  "github.com/rancher/local-path-provisioner@${LOCAL_PATH_PROVISIONER_VERSION}"
mv "$gobin/local-path-provisioner" "$bin/local-path-provisioner"
echo "$bin/local-path-provisioner"
