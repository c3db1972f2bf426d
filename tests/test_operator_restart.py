"""Restart safety: SIGKILL the operator at random points during prepare and
restart it; every run ends Ready with exactly one worker (local executor) or
one Job (kubernetes executor, on kwok's node) per step."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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
    full = {**os.environ, "KUBECONFIG": str(kubeconfig), "FERRY_RECONCILE_INTERVAL": "0.5", **env}
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


def test_sigkill_with_the_kubernetes_executor_never_duplicates_a_job(crd, namespace, tmp_path, identity):
    env = {"FERRY_EXECUTOR": "kubernetes", "FERRY_WORKER_IMAGE": "ghcr.io/ferry-dev/ferry:test",
           # kwok's node completes the pods without running them (as in test_operator_kubernetes.py)
           "FERRY_WORKER_NODE_SELECTOR": json.dumps({"type": "kwok"}),
           "FERRY_WORKER_TOLERATIONS": json.dumps([{"key": "nvidia.com/gpu", "operator": "Exists",
                                                    "effect": "NoSchedule"}])}
    rng = random.Random(11)
    operator = None
    for i in range(10):
        operator = start_operator(identity, namespace, tmp_path / "operator.log", **env)
        if i == 0:
            crd.apply(sharded("jobs", namespace, "hf://org/tiny-llama"))
        time.sleep(rng.uniform(0.3, 2.0))
        operator.send_signal(signal.SIGKILL)
        operator.wait()
    operator = start_operator(identity, namespace, tmp_path / "operator.log", **env)
    try:
        def both_jobs():
            items = crd.get_json("jobs", "-n", namespace)["items"]
            return items if len(items) >= 2 else None
        from cluster_support import wait_for
        items = wait_for(both_jobs, "the fetch and shard Jobs", timeout=90)
        time.sleep(3)
        items = crd.get_json("jobs", "-n", namespace)["items"]
        steps = sorted(j["metadata"]["labels"]["ferry.dev/step"] for j in items)
        assert steps == ["fetch", "shard"]  # one Job per step, whatever the kills
        uids = {j["metadata"]["uid"] for j in items}
        assert len(uids) == 2
    finally:
        crd.kubectl("delete", "mw", "--all", "-n", namespace, "--timeout=90s", check=False, timeout=120)
        operator.terminate()
        operator.wait(timeout=20)
