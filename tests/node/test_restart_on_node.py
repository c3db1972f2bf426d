"""Restart safety with the kubernetes executor, for real: the operator (a
process, under the chart's ClusterRole) SIGKILLed at 10 random points while
prepare Jobs run on the real node; every ModelWeights ends Ready with exactly
one Job per step (the local executor's twin is tests/test_operator_restart.py)."""
from __future__ import annotations

import json
import random
import signal
import time

import pytest

from cluster_support import wait_for
from node_support import modelweights, s3_secret, upload_dir, unique
from operator_identity import chart_operator_role, operator_identity
from test_operator_restart import start_operator

pytestmark = [pytest.mark.cluster, pytest.mark.node]


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
    names = [f"kill-{i}" for i in range(10)]
    with operator_identity(node, namespace, role, tmp_path) as (kubeconfig, _):
        for name in names:
            operator = start_operator(kubeconfig, namespace, tmp_path / "operator.log", **env)
            mw = modelweights(name, f"s3://{bucket}/tiny-llama",
                              {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}, secret="s3")
            mw["metadata"]["namespace"] = namespace
            node.apply(mw)
            time.sleep(rng.uniform(0.3, 4.0))  # start-up, claim, fetch Job, shard Job or recording the artifact
            operator.send_signal(signal.SIGKILL)
            operator.wait()
        operator = start_operator(kubeconfig, namespace, tmp_path / "operator.log", **env)
        try:
            def all_ready():
                items = node.get_json("mw", "-n", namespace)["items"]
                ready = [m for m in items if m.get("status", {}).get("phase") == "Ready"]
                return items if len(ready) == len(names) else None
            wait_for(all_ready, "every ModelWeights Ready", timeout=600)
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
