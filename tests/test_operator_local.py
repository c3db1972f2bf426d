"""The operator end to end on the embedded default: kopf against the real
kube-apiserver, the local executor running the real `ferry` worker."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

pytestmark = pytest.mark.cluster


@pytest.fixture
def operator(crd, namespace, tmp_path):
    root = tmp_path / "artifacts"
    env = {**os.environ, "KUBECONFIG": str(crd.kubeconfig), "FERRY_LOCAL_ROOT": str(root),
           "FERRY_EXECUTOR": "local", "FERRY_RECONCILE_INTERVAL": "1"}
    log = open(tmp_path / "operator.log", "wb")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("ferry-operator")), "run", "--standalone",
                             "--namespace", namespace], env=env, stdout=log, stderr=subprocess.STDOUT)
    yield root
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    if os.environ.get("FERRY_SHOW_OPERATOR_LOG"):
        print((tmp_path / "operator.log").read_text())


def tiny_checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_file({"model.embed_tokens.weight": rng.standard_normal((64, 16), dtype=np.float32),
               "model.norm.weight": np.ones(16, dtype=np.float32)}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (directory / "optimizer.pt").write_bytes(b"training state, never fetched")
    return directory


def modelweights(name, namespace, uri, **spec):
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"source": {"uri": uri}, "storage": {"pvc": {"size": "1Gi"}}, **spec}}


def wait_condition(kube, namespace, name, cond, timeout=120):
    proc = kube.kubectl("wait", f"--for=condition={cond}", f"mw/{name}", "-n", namespace, f"--timeout={timeout}s",
                        check=False, timeout=timeout + 10)
    if proc.returncode != 0:
        status = kube.get_json("mw", name, "-n", namespace).get("status")
        raise AssertionError(f"{name} never {cond}: {json.dumps(status, indent=1)}")


def test_safetensors_copy_becomes_ready_with_the_manifest_digest(crd, namespace, operator, tmp_path):
    src = tiny_checkpoint(tmp_path / "src")
    crd.apply(modelweights("tiny", namespace, f"file://{src}"))
    wait_condition(crd, namespace, "tiny", "Ready")
    status = crd.get_json("mw", "tiny", "-n", namespace)["status"]
    artifact_dir = Path(status["artifact"]["uri"].removeprefix("file://"))
    manifest = (artifact_dir / "ferry-manifest.json").read_bytes()
    assert status["artifact"]["manifestDigest"] == "sha256:" + hashlib.sha256(manifest).hexdigest()
    assert sorted(f["path"] for f in json.loads(manifest)["files"]) == ["config.json", "model.safetensors"]
    assert status["phase"] == "Ready" and status["observedGeneration"] == 1
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["Downloaded"]["status"] == "True"
    assert by_type["Reconciling"]["status"] == "False"
    assert "progress" not in status
    assert artifact_dir.is_relative_to(operator)


def test_a_source_without_weights_stalls_naming_it(crd, namespace, operator, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    crd.apply(modelweights("empty", namespace, f"file://{empty}"))
    wait_condition(crd, namespace, "empty", "Stalled")
    status = crd.get_json("mw", "empty", "-n", namespace)["status"]
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    assert stalled["reason"] == "FetchFailed" and str(empty) in stalled["message"], stalled
    assert status["phase"] == "Failed"
    assert not any((operator / namespace / "empty").rglob("ferry-manifest.json"))


def test_spec_change_prepares_a_new_artifact(crd, namespace, operator, tmp_path):
    src = tiny_checkpoint(tmp_path / "src")
    crd.apply(modelweights("rev", namespace, f"file://{src}"))
    wait_condition(crd, namespace, "rev", "Ready")
    first = crd.get_json("mw", "rev", "-n", namespace)["status"]["artifact"]["uri"]
    crd.apply(modelweights("rev", namespace, f"file://{src}", format={"tensorParallelSize": 2}))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = crd.get_json("mw", "rev", "-n", namespace)["status"]
        if status.get("observedGeneration") == 2 and status.get("phase") == "Ready":
            break
        time.sleep(0.5)
    assert status["observedGeneration"] == 2 and status["phase"] == "Ready", status
    assert status["artifact"]["uri"] != first and status["artifact"]["tensorParallelSize"] == 2
