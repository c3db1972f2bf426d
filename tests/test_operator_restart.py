"""Restart safety: SIGKILL the operator while a prepare step's worker runs
(fetch or shard, chosen at random; the test checks each kill landed there, on
an object not yet Ready) and restart it; every run ends Ready with exactly one
worker per step (local executor). The kubernetes executor's twin, with the
Jobs running for real, is tests/node/test_restart_on_node.py."""
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
KILLS = 10
KILL_WAIT_S = 60  # until the chosen step's worker runs (the shard's after the fetch), on two busy cores
READY_S = 300  # until every object is Ready, after the last restart


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


def running_step(steps: Path) -> str | None:
    """The step whose worker runs now: launched (its `.launches` record) and not yet exited (no `rc`)."""
    for launches in steps.glob("*.launches"):
        step_id = launches.name.removesuffix(".launches")
        if not (steps / step_id / "rc").exists():
            return step_id.split("-")[0]
    return None


def kill_while_running(operator: subprocess.Popen, steps: Path, step: str) -> None:
    """SIGKILL `operator` the moment `step`'s worker is seen running (polled every 20 ms)."""
    deadline = time.monotonic() + KILL_WAIT_S
    while running_step(steps) != step:
        assert time.monotonic() < deadline, f"{step} never seen running: {sorted(p.name for p in steps.glob('*'))}"
        time.sleep(0.02)
    operator.send_signal(signal.SIGKILL)
    operator.wait()


@pytest.mark.timeout(KILLS * KILL_WAIT_S + READY_S + 120 + 180)  # the waits, the deletion, start-ups
def test_sigkill_at_random_points_never_duplicates_a_worker(crd, namespace, tmp_path, identity):
    from checkpoints import LLAMA3, write_checkpoint

    source = tmp_path / "src"
    write_checkpoint(source, LLAMA3)
    root = tmp_path / "artifacts"
    env = {"FERRY_EXECUTOR": "local", "FERRY_LOCAL_ROOT": str(root)}
    rng = random.Random(7)
    names = [f"kill-{i}" for i in range(KILLS)]
    landed = {}  # name -> (the step running at the kill, the object's phase then)
    for name in names:
        operator = start_operator(identity, namespace, tmp_path / "operator.log", **env)
        crd.apply(sharded(name, namespace, f"file://{source}"))
        step = rng.choice(["fetch", "shard"])
        kill_while_running(operator, root / namespace / name / ".steps", step)
        # Nothing writes the status while no operator runs: this is the phase at the kill.
        landed[name] = (step, crd.get_json("mw", name, "-n", namespace).get("status", {}).get("phase"))
        assert landed[name][1] != "Ready", landed
    assert {step for step, _ in landed.values()} == {"fetch", "shard"}, landed
    operator = start_operator(identity, namespace, tmp_path / "operator.log", **env)
    try:
        ready_by = time.monotonic() + READY_S
        for name in names:
            wait_condition(crd, namespace, name, "Ready", timeout=max(1, round(ready_by - time.monotonic())))
            steps = root / namespace / name / ".steps"
            launches = {f.name.removesuffix(".launches"): len(f.read_text().split())
                        for f in steps.glob("*.launches")}
            assert sorted(k.split("-")[0] for k in launches) == ["fetch", "shard"], launches
            assert set(launches.values()) == {1}, f"{name}: {launches}"
    finally:
        crd.kubectl("delete", "mw", "--all", "-n", namespace, "--timeout=90s", check=False, timeout=120)
        operator.terminate()
        operator.wait(timeout=20)
