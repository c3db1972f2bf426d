"""Restart safety with the kubernetes executor, for real: the operator (a
process, under the chart's ClusterRole) SIGKILLed 10 times, each while a
prepare Job (fetch or shard, chosen at random) of a ModelWeights not yet
Ready runs on the real node, as the test checks at each kill; every
ModelWeights ends Ready with exactly one Job per step (the local executor's
twin is tests/test_operator_restart.py)."""
from __future__ import annotations

import json
import random
import signal
import subprocess

import pytest

from cluster_support import Kube, wait_for
from node_support import modelweights, s3_secret, upload_dir, unique
from operator_identity import chart_operator_role, operator_identity
from test_operator_restart import start_operator

pytestmark = [pytest.mark.cluster, pytest.mark.node]
KILLS = 10
KILL_WAIT_S = 120  # until the chosen step's Job runs (the shard's after the fetch's ran on the node)
READY_S = 600  # until every ModelWeights is Ready, after the last restart


def kill_while_running(kube: Kube, operator: subprocess.Popen, namespace: str, name: str, step: str) -> None:
    """SIGKILL `operator` once `name`'s `step` Job is seen created and not finished."""
    def running():
        for job in kube.get_json("jobs", "-n", namespace, "-l",
                                 f"ferry.dev/modelweights={name},ferry.dev/step={step}")["items"]:
            status = job.get("status", {})
            finished = any(c["type"] in ("Complete", "Failed") and c["status"] == "True"
                           for c in status.get("conditions", []))
            if not finished and not status.get("succeeded"):
                return job
    wait_for(running, f"{name}'s {step} Job running", KILL_WAIT_S)
    operator.send_signal(signal.SIGKILL)
    operator.wait()


@pytest.mark.timeout(KILLS * KILL_WAIT_S + READY_S + 130 + 270)  # the waits, the deletion, start-ups
def test_sigkill_during_real_jobs_ends_ready_with_one_job_per_step(node, chart_operator, node_s3, checkpoint,
                                                                    namespace, tmp_path):
    # The chart's operator role, allowed to bind the chart release's worker role.
    role = chart_operator_role()
    worker_role = f"{chart_operator['release']}-worker"
    for rule in role["rules"]:
        if rule.get("resourceNames"):
            rule["resourceNames"] = [worker_role]
    bucket = unique("kill")
    upload_dir(node_s3, bucket, "tiny-llama", checkpoint)
    s3_secret(node, namespace, "s3", node_s3)
    env = {"FERRY_EXECUTOR": "kubernetes", "FERRY_WORKER_IMAGE": chart_operator["image"],
           "FERRY_WORKER_CLUSTER_ROLE": worker_role,
           "FERRY_WORKER_RESOURCES": json.dumps({"requests": {"cpu": "50m", "memory": "128Mi"}})}
    rng = random.Random(13)
    names = [f"kill-{i}" for i in range(KILLS)]
    landed = {}  # name -> (the step whose Job ran at the kill, the object's phase then)
    with operator_identity(node, namespace, role, tmp_path) as (kubeconfig, _):
        for name in names:
            operator = start_operator(kubeconfig, namespace, tmp_path / "operator.log", **env)
            mw = modelweights(name, f"s3://{bucket}/tiny-llama",
                              {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}, secret="s3")
            mw["metadata"]["namespace"] = namespace
            node.apply(mw)
            step = rng.choice(["fetch", "shard"])
            kill_while_running(node, operator, namespace, name, step)
            # No operator watches this namespace now: the status is as the killed one left it.
            landed[name] = (step, node.get_json("mw", name, "-n", namespace).get("status", {}).get("phase"))
            assert landed[name][1] != "Ready", landed
        assert {step for step, _ in landed.values()} == {"fetch", "shard"}, landed
        operator = start_operator(kubeconfig, namespace, tmp_path / "operator.log", **env)
        try:
            def all_ready():
                items = node.get_json("mw", "-n", namespace)["items"]
                ready = [m for m in items if m.get("status", {}).get("phase") == "Ready"]
                return items if len(ready) == len(names) else None
            wait_for(all_ready, "every ModelWeights Ready", timeout=READY_S)
            jobs = node.get_json("jobs", "-n", namespace)["items"]
            for name in names:
                steps = sorted(j["metadata"]["labels"]["ferry.dev/step"] for j in jobs
                               if j["metadata"]["labels"].get("ferry.dev/modelweights") == name)
                # One Job per step, whatever the kills (and one that removes the staging once recorded).
                assert steps == ["fetch", "shard", "staging"], f"{name}: {steps}"
            # Each Job ran once: one pod, exit 0, on the real node.
            pods = node.get_json("pods", "-n", namespace, "-l", "ferry.dev/step,ferry.dev/step!=staging")["items"]
            assert len(pods) == 2 * len(names), [p["metadata"]["name"] for p in pods]
        finally:
            node.kubectl("delete", "mw", "--all", "-n", namespace, "--timeout=120s", check=False, timeout=130)
            operator.terminate()
            operator.wait(timeout=20)
