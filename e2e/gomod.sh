# Sourced by e2e/*/build.sh: build a program from the Go module proxy through a
# wrapper module. `go install pkg@version` would ask the proxy for the module's
# version list (for deprecations), which it may refuse; a wrapper module that
# requires the exact version asks only for that version.

gomod_require() {  # SRC_DIR WRAPPER_MODULE MODULE VERSION -> prints the module's directory in the module cache
  # Callers run this in $(...), where `set -e` is off: every failure returns explicitly.
  local src=$1 wrapper=$2 module=$3 version=$4 moddir goversion
  mkdir -p "$src" || return 1
  moddir=$(cd "$src" && CGO_ENABLED=0 GOFLAGS=-mod=mod go mod download -json "${module}@${version}" |
    python3 -c 'import json,sys; d=json.load(sys.stdin); sys.exit(d["Error"]) if d.get("Error") else print(d["Dir"])') ||
    { echo "gomod: cannot download ${module}@${version} from the Go module proxy" >&2; return 1; }
  if [[ ! -f "$src/go.mod" ]]; then
    goversion=$(awk '/^go /{print $2; exit}' "$moddir/go.mod")
    [[ -n "$goversion" ]] || { echo "gomod: no go directive in $moddir/go.mod" >&2; return 1; }
    {
      echo "module ${wrapper}"
      echo
      echo "go ${goversion}"
      echo
      echo "require ${module} ${version}"
    } > "$src/go.mod.tmp" && mv "$src/go.mod.tmp" "$src/go.mod"
  fi
  echo "$moddir"
}

gomod_build() {  # SRC_DIR OUT_BINARY PACKAGE [go build flags...]: a static build, at the lowest priority
  local src=$1 out=$2 pkg=$3
  shift 3
  (cd "$src" && CGO_ENABLED=0 GOFLAGS=-mod=mod nice -n 19 go build -trimpath "$@" -o "$out.tmp" "$pkg")
  mv "$out.tmp" "$out"
}
