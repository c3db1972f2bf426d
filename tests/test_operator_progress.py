"""A worker's progress reaches status.progress through the operator only, end
to end (real API server, local executor, the real S3 server behind a proxy
that holds the step): the worker writes its step's progress file, the
operator validates it and writes the status; the worker has no cluster
credentials at all."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from cluster_support import running_operator, wait_for
from fault_proxy import PASS, FaultProxy
from s3server import S3Server
from test_operator_local import wait_condition

pytestmark = pytest.mark.cluster


def checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in (1, 2):  # two files: the second is held while the first is done
        save_file({f"model.layers.{i}.mlp.weight": rng.standard_normal((1024, 1024), dtype=np.float32)},
                  str(directory / f"model-0000{i}-of-00002.safetensors"))
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return directory


def test_progress_is_copied_by_the_operator_while_the_step_is_held(crd, namespace, tmp_path):
    release = threading.Event()

    def hold_the_second_file(seen):
        if seen.method == "GET" and "model-00002" in seen.path:
            release.wait(120)  # a barrier, not a sleep: held until the test has seen the progress
        return PASS

    with S3Server(tmp_path / "s3") as s3, FaultProxy(s3.endpoint, hold_the_second_file) as proxy:
        client = s3.client()
        client.create_bucket(Bucket="models")
        for f in sorted(checkpoint(tmp_path / "src").iterdir()):
            client.upload_file(str(f), "models", f"llama/{f.name}")
        env = {**s3.env(), "AWS_ENDPOINT_URL": proxy.endpoint, "FERRY_PROGRESS_INTERVAL": "0.2"}
        with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                              FERRY_LOCAL_ROOT=str(tmp_path / "artifacts"), **env):
            crd.apply({"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
                       "metadata": {"name": "held", "namespace": namespace},
                       "spec": {"source": {"uri": "s3://models/llama"}, "storage": {"pvc": {"size": "1Gi"}}}})

            def progress():
                status = crd.get_json("mw", "held", "-n", namespace).get("status") or {}
                p = status.get("progress") or {}
                return p if p.get("bytesDone", 0) > 0 else None
            try:
                seen = wait_for(progress, "status.progress while the fetch is held", timeout=90)
            finally:
                release.set()
            assert seen["step"] == "fetch" and 0 < seen["percent"] < 100 and seen["bytesTotal"] > seen["bytesDone"]
            # Written by the operator; the worker had no cluster credentials (KUBECONFIG not passed on).
            managers = {m["manager"] for m in crd.get_json("mw", "held", "-n", namespace, "--show-managed-fields")
                        ["metadata"]["managedFields"]
                        if "f:progress" in json.dumps(m.get("fieldsV1", {}))}
            assert managers == {"ferry-operator"}, managers
            (state,) = [d for d in (tmp_path / "artifacts" / namespace / "held" / ".steps").iterdir() if d.is_dir()]
            assert json.loads((state / "progress.json").read_text())["step"] == "fetch"
            wait_condition(crd, namespace, "held", "Ready")
            assert "progress" not in crd.get_json("mw", "held", "-n", namespace)["status"]
