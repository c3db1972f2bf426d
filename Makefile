# Ferry: the two commands are `make demo` (the main job, on the embedded local
# control plane) and `make test`. Everything runs from the virtualenv in .venv/.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: all venv test test-unit crds controlplane cluster-up cluster-down demo clean

all: test

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[operator,worker,test]'
	touch $@

venv: $(VENV)/.installed

# Unit + integration tests. Builds (or reuses) the local control plane; the test
# session starts a cluster if none is running and stops the one it started.
test: venv controlplane
	$(PY) -m pytest $(PYTEST_ARGS)

# Tests that need no cluster (seconds).
test-unit: venv
	$(PY) -m pytest -m "not cluster" $(PYTEST_ARGS)

# Regenerate the CRD from the API types (crds/ and the chart's copy).
crds: venv
	$(VENV)/bin/ferry-operator crd -o crds/ferry.dev_modelweights.yaml -o charts/ferry/crds/ferry.dev_modelweights.yaml

# Build etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and
# helm from the Go module proxy, cached by version under ~/.cache/ferry.
controlplane:
	bash e2e/controlplane/build.sh

cluster-up: venv controlplane
	$(PY) e2e/localcluster.py up

cluster-down:
	$(PYTHON) e2e/localcluster.py down

demo: venv controlplane
	$(PY) e2e/demo.py

clean: cluster-down
	rm -rf $(VENV) .ferry
