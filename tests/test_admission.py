"""Admission against a real kube-apiserver + etcd: the generated CRD accepts
valid ModelWeights, rejects invalid ones with a message naming the field, and
keeps status writes off metadata.generation."""
from __future__ import annotations

import json

import pytest

from spec_cases import INVALID, VALID, manifest, with_

pytestmark = pytest.mark.cluster


def create(kube, ns, obj):
    return kube.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(obj), check=False)


@pytest.mark.parametrize("name", list(VALID))
def test_valid_manifests_are_accepted(crd, namespace, name):
    proc = create(crd, namespace, VALID[name])
    assert proc.returncode == 0, proc.stderr


def test_at_least_fifteen_invalid_cases():
    assert len({c[0] for c in INVALID}) >= 15


@pytest.mark.parametrize("case_id,obj,field,words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifests_are_rejected_naming_the_field(crd, namespace, case_id, obj, field, words):
    obj = json.loads(json.dumps(obj))
    obj["metadata"]["name"] = case_id
    proc = create(crd, namespace, obj)
    assert proc.returncode != 0, f"{case_id} was accepted"
    err = proc.stderr
    assert field in err, f"error does not name {field}:\n{err}"
    assert words in err, f"error does not say {words!r}:\n{err}"
    # Nothing was stored.
    assert crd.kubectl("get", "mw", case_id, "-n", namespace, check=False).returncode != 0


def test_defaults_are_applied_by_the_server(crd, namespace):
    obj = {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights", "metadata": {"name": "defaults"},
           "spec": {"source": {"uri": "hf://org/model"}, "storage": {"pvc": {"size": "1Gi"}}}}
    create(crd, namespace, obj)
    spec = crd.get_json("mw", "defaults", "-n", namespace)["spec"]
    assert spec["format"] == {"type": "safetensors", "tensorParallelSize": 1, "pipelineParallelSize": 1,
                              "vllmVersion": "0.32", "maxPartSize": "5Gi", "expertParallel": False,
                              "expertPlacement": "linear", "target": "hopper"}
    assert spec["deletionPolicy"] == "Retain"
    assert spec["storage"]["pvc"]["accessModes"] == ["ReadWriteOnce"]


def test_storage_class_is_immutable(crd, namespace):
    crd.apply({**manifest("immutable"), "metadata": {"name": "immutable", "namespace": namespace}})
    changed = with_("storage.pvc.storageClassName", "slow", manifest("immutable"))
    changed["metadata"]["namespace"] = namespace
    proc = crd.kubectl("apply", "-f", "-", input=json.dumps(changed), check=False)
    assert proc.returncode != 0
    assert "spec.storage.pvc.storageClassName" in proc.stderr and "immutable" in proc.stderr


def test_status_subresource_does_not_bump_generation(crd, namespace):
    crd.apply({**manifest("gen"), "metadata": {"name": "gen", "namespace": namespace}})
    before = crd.get_json("mw", "gen", "-n", namespace)
    assert before["metadata"]["generation"] == 1
    status = {"status": {
        "observedGeneration": 1, "phase": "Fetching",
        "conditions": [{"type": "Ready", "status": "False", "reason": "Fetching", "message": "3/7 files",
                        "lastTransitionTime": "2026-11-29T12:00:00Z", "observedGeneration": 1}],
        "progress": {"step": "fetch", "bytesDone": 1 << 30, "bytesTotal": 4 << 30, "bytesPerSecond": 1 << 28,
                     "etaSeconds": 12, "percent": 25},
    }}
    crd.kubectl("patch", "mw", "gen", "-n", namespace, "--subresource=status", "--type=merge",
                "-p", json.dumps(status))
    after = crd.get_json("mw", "gen", "-n", namespace)
    assert after["metadata"]["generation"] == 1
    assert after["status"]["progress"]["percent"] == 25
    # Status sent through the main resource is ignored (status is a subresource).
    crd.kubectl("patch", "mw", "gen", "-n", namespace, "--type=merge", "-p", json.dumps({"status": {"phase": "Ready"}}))
    assert crd.get_json("mw", "gen", "-n", namespace)["status"]["phase"] == "Fetching"
    # A spec change does bump it.
    crd.kubectl("patch", "mw", "gen", "-n", namespace, "--type=merge",
                "-p", json.dumps({"spec": {"format": {"tensorParallelSize": 8}}}))
    assert crd.get_json("mw", "gen", "-n", namespace)["metadata"]["generation"] == 2


def test_invalid_status_is_rejected(crd, namespace):
    crd.apply({**manifest("badstatus"), "metadata": {"name": "badstatus", "namespace": namespace}})
    bad = {"status": {"conditions": [{"type": "Ready", "status": "Maybe", "reason": "X", "message": "",
                                      "lastTransitionTime": "2026-11-29T12:00:00Z"}]}}
    proc = crd.kubectl("patch", "mw", "badstatus", "-n", namespace, "--subresource=status", "--type=merge",
                       "-p", json.dumps(bad), check=False)
    assert proc.returncode != 0 and "status.conditions[0].status" in proc.stderr


def test_short_name_printer_columns_and_wait(crd, namespace):
    crd.apply({**manifest("cols"), "metadata": {"name": "cols", "namespace": namespace}})
    crd.kubectl("patch", "mw", "cols", "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"phase": "Ready", "artifact": {"uri": "pvc://cols-weights/cols", "format": "sharded_state",
                                                   "tensorParallelSize": 4, "totalBytes": 140 << 30, "size": "140Gi"},
                    "progress": {"percent": 100},
                    "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": "",
                                    "lastTransitionTime": "2026-11-29T12:00:00Z"}]}}))
    table = crd.kubectl("get", "mw", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "READY", "FORMAT", "TP", "SIZE", "LOADED", "CACHED", "PROGRESS", "AGE"]
    assert table[1].split()[:7] == ["cols", "Ready", "True", "sharded_state", "4", "140Gi", "100"]
    crd.kubectl("wait", "--for=condition=Ready", "mw/cols", "-n", namespace, "--timeout=5s")


def test_kubectl_explain_teaches_the_format_field(crd):
    out = crd.kubectl("explain", "modelweights.spec.format").stdout
    for words in ("vLLM --load-format", "tensorParallelSize", "vllmVersion", "sharded_state"):
        assert words in out, out
