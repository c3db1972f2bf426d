#!/usr/bin/env bash
# Build the local S3-compatible server (gofakes3's own command) from the Go
# module proxy into a cache keyed by version, outside the repo. A warm cache
# returns in milliseconds.
#
#   e2e/s3/build.sh            -> prints the path of the gofakes3 binary
#
# Prebuilt binary: set FERRY_S3_SERVER to its path; nothing is built then.
#
# Why gofakes3: a single static binary, buildable offline from the module
# proxy, with a filesystem backend that streams objects from disk (multi-GiB
# objects in bounded memory) and honours ranged GETs; its memory backend holds
# keys a filesystem cannot (e.g. "prefix/../../etc/passwd"), which the
# path-traversal tests need.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

if [[ -n "${FERRY_S3_SERVER:-}" ]]; then
  [[ -x "$FERRY_S3_SERVER" ]] || { echo "build.sh: $FERRY_S3_SERVER is not executable (FERRY_S3_SERVER)" >&2; exit 1; }
  echo "$FERRY_S3_SERVER"; exit 0
fi

cache=${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}
bin="$cache/s3/gofakes3-${GOFAKES3_VERSION}/bin"
if [[ -x "$bin/gofakes3" ]]; then echo "$bin/gofakes3"; exit 0; fi

command -v go >/dev/null || { echo "build.sh: Go is needed to build the S3 server (or set FERRY_S3_SERVER)" >&2; exit 1; }
mkdir -p "$bin"
echo "[s3] building gofakes3 ${GOFAKES3_VERSION}" >&2
gobin=$(mktemp -d)
trap 'rm -rf "$gobin"' EXIT
GOBIN="$gobin" CGO_ENABLED=0 GOFLAGS=-mod=mod go install -ldflags "-s -w" \
  "github.com/johannesboyne/gofakes3/cmd/gofakes3@${GOFAKES3_VERSION}"
mv "$gobin/gofakes3" "$bin/gofakes3"
echo "$bin/gofakes3"
