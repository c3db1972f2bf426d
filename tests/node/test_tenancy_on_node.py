"""Data belongs to one object, on the real node: two ModelWeights that name
the same claim and subPath, with the same source and format (so the same spec
digest), prepare into directories of their own (the uid is in the path), and
re-speccing or deleting one leaves the other's artifact intact and Ready.
Real Jobs of the chart's operator, a dynamically provisioned claim, checked
from the host."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster_support import wait_for
from node_support import NAMESPACE, claim_dir, mw_status, s3_secret, unique, upload_dir, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.node]
FERRY = Path(sys.executable).with_name("ferry")


def on_shared_claim(name: str, claim: str, bucket: str, fmt: dict) -> dict:
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"source": {"uri": f"s3://{bucket}/tiny-llama", "credentialsSecretRef": {"name": f"{bucket}-s3"}},
                     "storage": {"pvc": {"name": claim, "subPath": "models/llama"}}, "format": fmt,
                     "deletionPolicy": "Delete"}}


def verified(node, uri: str) -> Path:
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    artifact = claim_dir(node, claim) / path
    check = subprocess.run([str(FERRY), "verify", str(artifact)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    return artifact


def test_two_modelweights_on_one_claim_never_touch_each_others_artifact(node, chart_operator, node_s3, checkpoint):
    bucket = unique("shared")
    upload_dir(node_s3, bucket, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{bucket}-s3", node_s3)
    claim = f"{bucket}-claim"
    node.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": NAMESPACE},
                "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    plain = {"type": "safetensors"}
    first, second = f"{bucket}-a", f"{bucket}-b"
    node.apply(on_shared_claim(first, claim, bucket, plain))
    node.apply(on_shared_claim(second, claim, bucket, plain))
    a, b = wait_ready(node, NAMESPACE, first), wait_ready(node, NAMESPACE, second)
    assert a["artifact"]["specDigest"] == b["artifact"]["specDigest"]  # the same spec: once the same path
    assert a["artifact"]["uri"] != b["artifact"]["uri"]
    mine = verified(node, a["artifact"]["uri"])
    old_b = verified(node, b["artifact"]["uri"])

    # Re-spec the second (Delete: its superseded artifact goes once the new one is Ready).
    node.kubectl("patch", "mw", second, "-n", NAMESPACE, "--type=merge", "-p",
                 '{"spec": {"format": {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}}}')
    wait_for(lambda: (s := mw_status(node, NAMESPACE, second)).get("observedGeneration") == 2
             and s.get("phase") == "Ready", f"{second} re-prepared", timeout=240)
    wait_for(lambda: not old_b.parent.exists(), f"{second}'s superseded artifact removed by its cleanup Job",
             timeout=120)
    assert verified(node, a["artifact"]["uri"]) == mine  # the first's, at the same digest, untouched

    # Delete the second: the first stays Ready and intact.
    node.kubectl("delete", "mw", second, "-n", NAMESPACE, "--timeout=120s")
    status = mw_status(node, NAMESPACE, first)
    assert next(c for c in status["conditions"] if c["type"] == "Ready")["status"] == "True"
    assert status["artifact"] == a["artifact"]
    verified(node, a["artifact"]["uri"])
    node.kubectl("delete", "mw", first, "-n", NAMESPACE, "--timeout=120s")
