"""Real failures on the real node reach the ModelWeights status with a reason a
human can act on, and quickly: none of them is reported as running forever."""
from __future__ import annotations

import json
import time

import pytest

from node_support import (NAMESPACE, condition, install_chart, modelweights, mw_status, s3_secret, uninstall_chart,
                      unique, upload_dir, wait_ready, wait_stalled)

pytestmark = [pytest.mark.cluster, pytest.mark.node]
TP2 = {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}
MISSING_IMAGE = "ferry.local/ferry:does-not-exist"


def stalled_quickly(kube, namespace, name, timeout=120) -> tuple[dict, float]:
    start = time.monotonic()
    stalled = wait_stalled(kube, namespace, name, timeout)
    return stalled, time.monotonic() - start


def test_missing_credentials_secret(node, chart_operator):
    name = unique("nosecret")
    node.apply(modelweights(name, "s3://models/tiny-llama", TP2, secret="no-such-secret"))
    stalled, _ = stalled_quickly(node, NAMESPACE, name)
    assert "no-such-secret" in stalled["message"], stalled
    assert "secret" in stalled["message"].lower()
    assert condition(mw_status(node, NAMESPACE, name), "Ready")["status"] == "False"


def test_source_without_weights_reports_the_workers_own_message(node, chart_operator, node_s3, tmp_path):
    name = unique("noweights")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    upload_dir(node_s3, name, "not-a-model", tmp_path / "empty")
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    node.apply(modelweights(name, f"s3://{name}/not-a-model", TP2, secret=f"{name}-s3"))
    stalled, _ = stalled_quickly(node, NAMESPACE, name)
    # The worker's real termination message, written inside the pod.
    assert "fetch failed" in stalled["message"] and "not-a-model" in stalled["message"], stalled
    pods = node.get_json("pods", "-n", NAMESPACE, "-l", f"ferry.dev/modelweights={name}")["items"]
    codes = {p["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] for p in pods}
    assert codes and 0 not in codes


def test_claim_whose_storage_class_does_not_exist(node, chart_operator):
    name = unique("nosc")
    node.apply(modelweights(name, "s3://models/tiny-llama", TP2, storageClassName="does-not-exist"))
    stalled, _ = stalled_quickly(node, NAMESPACE, name)
    assert "does-not-exist" in stalled["message"] and "StorageClass" in stalled["message"], stalled


@pytest.fixture(scope="module")
def operator_with_missing_worker_image(node, images):
    release, namespace, watch = "ferry-badimage", "ferry-badimage", "node-e2e-badimage"
    install_chart(node, release, namespace, watch, images["ferry"]["ref"], f"worker.image={MISSING_IMAGE}")
    yield watch
    uninstall_chart(node, release, namespace, watch)


def test_worker_image_missing_on_the_node(node, operator_with_missing_worker_image, node_s3, checkpoint):
    watch = operator_with_missing_worker_image
    name = unique("noimage")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, watch, f"{name}-s3", node_s3)
    mw = modelweights(name, f"s3://{name}/tiny-llama", TP2, secret=f"{name}-s3")
    mw["metadata"]["namespace"] = watch
    node.apply(mw)
    stalled, _ = stalled_quickly(node, watch, name)
    assert MISSING_IMAGE in stalled["message"], stalled


def test_operator_without_a_permission_says_which(node, chart_operator, node_s3, checkpoint):
    """The chart's Role in the watched namespace (a namespaced install) is what
    the running operator has: take away `create` on Jobs and the status says
    so; give it back and it converges."""
    role = node.get_json("role", chart_operator["role"], "-n", NAMESPACE)
    original = json.loads(json.dumps(role))
    for rule in role["rules"]:
        if rule.get("resources") == ["jobs"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
        role["metadata"].pop(key, None)
    node.kubectl("replace", "-f", "-", input=json.dumps(role))
    name = unique("forbidden")
    try:
        upload_dir(node_s3, name, "tiny-llama", checkpoint)
        s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
        node.apply(modelweights(name, f"s3://{name}/tiny-llama", {"type": "safetensors"}, secret=f"{name}-s3"))
        stalled, _ = stalled_quickly(node, NAMESPACE, name)
        assert "jobs" in stalled["message"] and "create" in stalled["message"], stalled
        assert chart_operator["service_account"] in stalled["message"], stalled
    finally:
        for key in ("resourceVersion", "uid", "creationTimestamp", "managedFields"):
            original["metadata"].pop(key, None)
        node.kubectl("replace", "-f", "-", input=json.dumps(original))
    # Stalled until the next reconcile sees the permission again; then Ready.
    wait_ready(node, NAMESPACE, name, stalled_ok=True)
