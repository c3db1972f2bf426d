#!/usr/bin/env bash
# Build the local control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok), a kubectl, a kubelet and kube-proxy (the real node) of the same
# release and helm from the Go
# module proxy, into a cache keyed by version outside the repo. A warm cache
# returns in milliseconds.
#
#   e2e/controlplane/build.sh            -> prints the bin directory
#
# Prebuilt binaries: set FERRY_K8S_ASSETS (or KUBEBUILDER_ASSETS) to a directory
# holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl, kubelet, kube-proxy, kwok and helm; nothing is built then.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

tools=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy kwok helm)

assets=${FERRY_K8S_ASSETS:-${KUBEBUILDER_ASSETS:-}}
if [[ -n "$assets" ]]; then
  for t in "${tools[@]}"; do
    [[ -x "$assets/$t" ]] || { echo "build.sh: $assets/$t missing (FERRY_K8S_ASSETS)" >&2; exit 1; }
  done
  echo "$assets"; exit 0
fi

cache=${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}
key="k8s-${KUBERNETES_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}"
bin="$cache/controlplane/$key/bin"
missing=()
for t in "${tools[@]}"; do [[ -x "$bin/$t" ]] || missing+=("$t"); done
if [[ ${#missing[@]} -eq 0 ]]; then echo "$bin"; exit 0; fi

command -v go >/dev/null || { echo "build.sh: Go is needed to build the control plane (or set FERRY_K8S_ASSETS)" >&2; exit 1; }
work="$cache/controlplane/$key/src"
mkdir -p "$bin" "$work"
export GOFLAGS=-mod=mod CGO_ENABLED=0
ldflags="-s -w"
log() { echo "[controlplane] $*" >&2; }

build_kubernetes() {
  local mod="$work/kubernetes" v0="v0.${KUBERNETES_VERSION#v1.}"
  mkdir -p "$mod"
  if [[ ! -f "$mod/go.mod" ]]; then
    # k8s.io/kubernetes replaces its staging modules with ./staging paths; a
    # consumer must replace each with the published v0.X.Y of the same release.
    local upstream
    upstream=$(cd "$mod" && go mod download -json "k8s.io/kubernetes@${KUBERNETES_VERSION}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
    {
      echo "module ferry.dev/controlplane"
      echo
      echo "go $(awk '/^go /{print $2; exit}' "$upstream")"
      echo
      echo "require k8s.io/kubernetes ${KUBERNETES_VERSION}"
      echo
      grep -oE '^\s*k8s.io/[a-z0-9-]+ => ./staging' "$upstream" | awk '{print $1}' | sort -u |
        while read -r m; do echo "replace $m => $m $v0"; done
    } > "$mod/go.mod"
  fi
  local targets=()
  for t in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy; do
    [[ -x "$bin/$t" ]] || targets+=("$t")
  done
  for t in "${targets[@]}"; do
    log "building $t ${KUBERNETES_VERSION}"
    (cd "$mod" && go build -ldflags "$ldflags -X k8s.io/component-base/version.gitVersion=${KUBERNETES_VERSION} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$KUBERNETES_VERSION" | cut -d. -f2)" \
      -o "$bin/$t.tmp" "k8s.io/kubernetes/cmd/$t") && mv "$bin/$t.tmp" "$bin/$t"
  done
}

build_etcd() {
  [[ -x "$bin/etcd" ]] && return
  local mod="$work/etcd"
  mkdir -p "$mod"
  cat > "$mod/main.go" <<'GO'
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
  [[ -f "$mod/go.mod" ]] || (cd "$mod" && go mod init ferry.dev/etcd >/dev/null 2>&1 && go get "go.etcd.io/etcd/server/v3@${ETCD_VERSION}" >&2)
  log "building etcd ${ETCD_VERSION}"
  (cd "$mod" && go build -ldflags "$ldflags" -o "$bin/etcd.tmp" .) && mv "$bin/etcd.tmp" "$bin/etcd"
}

go_install() {  # name module/path@version
  local name=$1 pkg=$2
  [[ -x "$bin/$name" ]] && return
  log "building $name ($pkg)"
  GOBIN="$work/gobin" go install -ldflags "$ldflags" "$pkg"
  mv "$work/gobin/$name" "$bin/$name"
}

build_etcd
go_install kwok "sigs.k8s.io/kwok/cmd/kwok@${KWOK_VERSION}"
go_install helm "helm.sh/helm/v3/cmd/helm@${HELM_VERSION}"
build_kubernetes
echo "$bin"
