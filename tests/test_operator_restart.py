"""Restart safety: SIGKILL the operator at random points during prepare and
restart it; every run ends Ready with exactly one worker per step (local
executor). The kubernetes executor's twin, with the Jobs running for real, is
tests/node/test_restart_on_node.py."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import localcluster
from cluster_support import Kube, admission_policies
from operator_identity import chart_operator_role, operator_identity
from test_operator_local import wait_condition

pytestmark = pytest.mark.cluster
OPERATOR = Path(sys.executable).with_name("ferry-operator")


@pytest.fixture
def identity(crd, namespace, tmp_path):
    """The chart's operator ClusterRole, as a ServiceAccount token kubeconfig."""
    with operator_identity(crd, namespace, chart_operator_role(), tmp_path) as (kubeconfig, _):
        yield kubeconfig


def start_operator(kubeconfig: Path, namespace, log: Path, **env) -> subprocess.Popen:
    full = {**os.environ, "KUBECONFIG": str(kubeconfig), "FERRY_RECONCILE_INTERVAL": "0.5",
            "FERRY_ADMISSION_POLICIES": admission_policies(Kube(localcluster.KUBECONFIG, localcluster.kubectl_path())),
            **env}
    with open(log, "ab") as out:
        return subprocess.Popen([str(OPERATOR), "run", "--standalone", "--namespace", namespace], env=full,
                                stdout=out, stderr=subprocess.STDOUT)


def sharded(name, namespace, uri):
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights", "metadata": {"name": name, "namespace": namespace},
            "spec": {"source": {"uri": uri}, "storage": {"pvc": {"size": "1Gi"}},
                     "format": {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}}}


def test_sigkill_at_random_points_never_duplicates_a_worker(crd, namespace, tmp_path, identity):
    from checkpoints import LLAMA3, write_checkpoint

    source = tmp_path / "src"
    write_checkpoint(source, LLAMA3)
    root = tmp_path / "artifacts"
    env = {"FERRY_EXECUTOR": "local", "FERRY_LOCAL_ROOT": str(root)}
    rng = random.Random(7)
    names = [f"kill-{i}" for i in range(10)]
    for name in names:
        operator = start_operator(identity, namespace, tmp_path / "operator.log", **env)
        crd.apply(sharded(name, namespace, f"file://{source}"))
        time.sleep(rng.uniform(0.5, 4.0))  # somewhere in start-up, fetch, shard or wiring
        operator.send_signal(signal.SIGKILL)
        operator.wait()
    operator = start_operator(identity, namespace, tmp_path / "operator.log", **env)
    try:
        for name in names:
            wait_condition(crd, namespace, name, "Ready", timeout=180)
            steps = root / namespace / name / ".steps"
            launches = {f.name.removesuffix(".launches"): len(f.read_text().split())
                        for f in steps.glob("*.launches")}
            assert sorted(k.split("-")[0] for k in launches) == ["fetch", "shard"], launches
            assert set(launches.values()) == {1}, f"{name}: {launches}"
    finally:
        crd.kubectl("delete", "mw", "--all", "-n", namespace, "--timeout=90s", check=False, timeout=120)
        operator.terminate()
        operator.wait(timeout=20)
