#!/usr/bin/env bash
# Try Ferry on kind (needs Docker, kind, kubectl, helm). Not run in CI here:
# this project's CI machines have no Docker engine; e2e/localcluster.py is the
# Docker-free equivalent that the tests use.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p /tmp/ferry-kind-models
kind get clusters | grep -qx ferry || kind create cluster --config "$repo/e2e/kind/kind-config.yaml"
docker build -f "$repo/worker_image/Dockerfile" -t ferry:dev "$repo"
kind load docker-image ferry:dev --name ferry
helm upgrade --install ferry "$repo/charts/ferry" --namespace ferry-system --create-namespace \
  --set image.repository=ferry --set image.tag=dev --set image.pullPolicy=Never --wait
kubectl get crd modelweights.ferry.dev
echo "Ferry is installed on kind-ferry. Try: kubectl apply -f $repo/e2e/examples/"
