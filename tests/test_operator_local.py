"""The operator end to end on the embedded default: kopf against the real
kube-apiserver, the local executor running the real `ferry` worker."""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from cluster_support import running_operator, wait_for
from safetensors.numpy import save_file

pytestmark = pytest.mark.cluster


@pytest.fixture
def metrics_port() -> int:
    """Where the operator fixture serves its Prometheus metrics (test_operator_metrics.scrape reads them)."""
    from test_operator_metrics import free_port  # here, not above: that module imports this one

    return free_port()


@pytest.fixture
def operator(crd, namespace, tmp_path, metrics_port):
    root = tmp_path / "artifacts"
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                          FERRY_LOCAL_ROOT=str(root), FERRY_METRICS_BIND=f"127.0.0.1:{metrics_port}"):
        yield root


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


def wait_ready_generation(kube, namespace, name, generation, timeout=90):
    """The status once the operator has made `generation` Ready."""
    def ready():
        status = kube.get_json("mw", name, "-n", namespace).get("status", {})
        return status if status.get("observedGeneration") == generation and status.get("phase") == "Ready" else None
    return wait_for(ready, f"{name} generation {generation} Ready", timeout)


def reconcile_on_request(kube, namespace, name, port) -> dict:
    """Annotate ferry.dev/requested-at and wait until a reconcile consumed it: the operator's count of ok
    reconciles grew and the status records the annotation (lastHandledRequestedAt, which only a reconcile
    that read it writes, at its end). That status."""
    from test_operator_metrics import scrape

    ok = ("ferry_reconcile_total", (("result", "ok"),))
    before = scrape(port).get(ok, 0)
    stamp = f"{time.time():.6f}"
    kube.kubectl("annotate", f"mw/{name}", "-n", namespace, f"ferry.dev/requested-at={stamp}", "--overwrite")

    def consumed():
        status = kube.get_json("mw", name, "-n", namespace).get("status", {})
        return status if status.get("lastHandledRequestedAt") == stamp and scrape(port).get(ok, 0) > before else None
    return wait_for(consumed, f"a reconcile of {name} that read requested-at {stamp}", timeout=30)


def test_safetensors_copy_becomes_ready_with_the_manifest_digest(crd, namespace, operator, metrics_port, tmp_path):
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
    # Every transition is a core Event on the object: `kubectl describe mw` tells the story.
    def story():
        events = crd.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=tiny")["items"]
        return sorted(e["reason"] for e in events for _ in range(e.get("count") or 1))
    wait_for(lambda: "Ready" in story(), "the Ready Event")
    # Each once (same-second Events have no order to check).
    assert story() == sorted(["StepStarted", "StepSucceeded", "ArtifactReady", "Ready"])
    described = crd.kubectl("describe", "mw", "tiny", "-n", namespace).stdout
    assert "StepStarted" in described and "ArtifactReady" in described
    # Durable facts: with the worker's records gone, a reconcile (asked for, and waited for) re-runs
    # nothing, and the status stays as it was but for the request it records.
    steps_dir = operator / namespace / "tiny" / ".steps"
    before = crd.get_json("mw", "tiny", "-n", namespace)["status"]
    shutil.rmtree(steps_dir)
    after = reconcile_on_request(crd, namespace, "tiny", metrics_port)
    assert not steps_dir.exists()
    assert {k: v for k, v in after.items() if k != "lastHandledRequestedAt"} == before
    assert after["phase"] == "Ready" and after["artifact"] == status["artifact"]


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
    changed = modelweights("rev", namespace, f"file://{src}")
    changed["spec"]["source"]["allowPatterns"] = ["*.safetensors"]  # selection shapes the artifact
    crd.apply(changed)
    status = wait_ready_generation(crd, namespace, "rev", 2)
    assert status["artifact"]["uri"] != first


def vllm_deployment(namespace, name="tiny-vllm"):
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [
                    {"name": "sidecar", "image": "busybox"},
                    {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                     "args": ["--model", "placeholder", "--max-model-len", "4096", "-tp=8"],
                     "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}}


def replica_sets(kube, namespace, app):
    return kube.get_json("rs", "-n", namespace, "-l", f"app={app}")["items"]


def test_serving_deployment_is_wired_and_rolled_on_spec_change(crd, namespace, operator, tmp_path):
    src = tiny_checkpoint(tmp_path / "src")
    crd.apply(vllm_deployment(namespace))
    crd.apply(modelweights("served", namespace, f"file://{src}",
                           serving={"deployments": [{"name": "tiny-vllm", "container": "vllm"}]}))
    wait_condition(crd, namespace, "served", "Ready")
    status = crd.get_json("mw", "served", "-n", namespace)["status"]
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["ServingUpdated"]["status"] == "True"
    dep = crd.get_json("deployment", "tiny-vllm", "-n", namespace)
    template = dep["spec"]["template"]
    sidecar, vllm = template["spec"]["containers"]
    assert "args" not in sidecar  # only the named container is touched
    assert vllm["args"] == ["--max-model-len", "4096", "--model", "/ferry/weights", "--load-format", "safetensors",
                            "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
                            "--served-model-name", "placeholder"]  # the name the container served
    assert template["metadata"]["annotations"]["ferry.dev/artifact-digest"] == status["artifact"]["manifestDigest"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["ferry-weights"]["hostPath"]["path"] == status["artifact"]["uri"].removeprefix("file://")
    assert set(volumes) == {"ferry-weights", "ferry-loader-token"}  # the loader's pod-bound token
    assert vllm["volumeMounts"] == [{"name": "ferry-weights", "mountPath": "/ferry/weights", "readOnly": True}]
    (loader,) = template["spec"]["initContainers"]
    assert loader["args"][:3] == ["load", "--artifact", "/ferry/weights"]
    assert template["spec"]["readinessGates"] == [{"conditionType": "ferry.dev/weights-loaded"}]
    # kwok fakes the gate True on its pods (no loader runs there): both replicas count as loaded.
    assert status["loaded"]["summary"] == "2/2"
    assert dep["status"]["updatedReplicas"] == 2 and dep["status"]["availableReplicas"] == 2
    generation = dep["metadata"]["generation"]
    first_uri = status["artifact"]["uri"]

    # A serving flag change rolls the Deployment once, on the same artifact.
    crd.apply(modelweights("served", namespace, f"file://{src}", format={"tensorParallelSize": 2},
                           serving={"deployments": [{"name": "tiny-vllm", "container": "vllm"}]}))
    status = wait_ready_generation(crd, namespace, "served", 2)
    dep = crd.get_json("deployment", "tiny-vllm", "-n", namespace)
    vllm = dep["spec"]["template"]["spec"]["containers"][1]
    assert vllm["args"][vllm["args"].index("--tensor-parallel-size") + 1] == "2"
    assert dep["metadata"]["generation"] == generation + 1  # exactly one more rollout
    assert dep["spec"]["template"]["metadata"]["annotations"]["ferry.dev/artifact-digest"] == \
        status["artifact"]["manifestDigest"]
    assert status["artifact"]["uri"] == first_uri  # nothing re-prepared
    assert len(replica_sets(crd, namespace, "tiny-vllm")) == 3  # original, first wiring, the change


def test_a_rollout_in_place_that_never_ends_gives_the_strategy_back_when_its_modelweights_goes(
        crd, namespace, operator, tmp_path):
    """serving.rollout InPlace on a Deployment whose pods can never run (more GPUs than any node has): the
    wiring patch sets maxSurge 0 with the Deployment's own strategy saved; deleting the ModelWeights puts it
    back (the delete handler, before the finalizer goes)."""
    src = tiny_checkpoint(tmp_path / "src")
    dep = vllm_deployment(namespace, "stuck")
    dep["spec"]["template"]["spec"]["containers"][1]["resources"] = {"limits": {"nvidia.com/gpu": "64"}}
    own = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 2, "maxUnavailable": 0}}
    dep["spec"]["strategy"] = own
    crd.apply(dep)
    crd.apply(modelweights("inplace", namespace, f"file://{src}",
                           serving={"deployments": [{"name": "stuck", "container": "vllm"}],
                                    "rollout": {"strategy": "InPlace"}}))

    def in_place():
        d = crd.get_json("deployment", "stuck", "-n", namespace)
        return d if d["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0 else None
    d = wait_for(in_place, "deployment stuck rolling in place", 120)
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert json.loads(d["metadata"]["annotations"]["ferry.dev/rollout-strategy"]) == own
    assert d["spec"]["template"]["metadata"]["annotations"]["ferry.dev/modelweights"] == "inplace"
    crd.kubectl("delete", "mw", "inplace", "-n", namespace, "--wait=true", "--timeout=60s", timeout=90)
    d = crd.get_json("deployment", "stuck", "-n", namespace)
    assert d["spec"]["strategy"] == own
    assert "ferry.dev/rollout-strategy" not in (d["metadata"].get("annotations") or {})


def test_missing_container_stalls_naming_it(crd, namespace, operator, tmp_path):
    src = tiny_checkpoint(tmp_path / "src")
    crd.apply(vllm_deployment(namespace, "other"))
    crd.apply(modelweights("wrong", namespace, f"file://{src}",
                           serving={"deployments": [{"name": "other", "container": "engine"}]}))
    wait_condition(crd, namespace, "wrong", "Stalled")
    status = crd.get_json("mw", "wrong", "-n", namespace)["status"]
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    assert stalled["reason"] == "ServingError" and "'engine'" in stalled["message"]


@pytest.mark.parametrize("policy,kept", [("Retain", True), ("Delete", False)])
def test_deletion_policy(crd, namespace, operator, metrics_port, tmp_path, policy, kept):
    from test_operator_metrics import scrape

    src = tiny_checkpoint(tmp_path / "src")
    crd.apply(modelweights("gone", namespace, f"file://{src}", deletionPolicy=policy))
    wait_condition(crd, namespace, "gone", "Ready")
    artifact = Path(crd.get_json("mw", "gone", "-n", namespace)["status"]["artifact"]["uri"].removeprefix("file://"))
    crd.kubectl("delete", "mw", "gone", "-n", namespace, "--timeout=60s")
    # kubectl returns once the object is gone: after the operator's delete handler, where any removal
    # happens (synchronously), returned. It ran: its first act drops the object from the phase gauge.
    assert scrape(metrics_port)[("ferry_modelweights", (("phase", "Ready"),))] == 0
    removing = "deletionPolicy Delete: removing prepared data" in (tmp_path / "operator.log").read_text()
    assert removing is not kept
    if kept:
        assert (artifact / "ferry-manifest.json").exists()
    else:
        wait_for(lambda: not artifact.exists(), "the artifact to be removed", timeout=30)


def test_fp8_block_scaled_checkpoint_is_sharded_and_a_cut_of_partial_blocks_stalls_at_once(crd, namespace, operator,
                                                                                             tmp_path):
    """An FP8 release (DeepSeek-V3's layout) through the operator's sharded_state format; a TP size that
    would leave a rank partial scale blocks stalls with the worker's reason, without retries."""
    from checkpoints import LLAMA3, ModelCase, fp8_block_config, write_checkpoint

    fine = ModelCase("fp8", fp8_block_config(LLAMA3.config, [16, 16]), "BF16")
    write_checkpoint(tmp_path / "fp8", fine)
    fmt = {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}
    crd.apply(modelweights("fp8", namespace, f"file://{tmp_path / 'fp8'}", format=fmt))
    wait_condition(crd, namespace, "fp8", "Ready")
    status = crd.get_json("mw", "fp8", "-n", namespace)["status"]
    artifact = Path(status["artifact"]["uri"].removeprefix("file://"))
    manifest = json.loads((artifact / "ferry-manifest.json").read_bytes())
    assert manifest["extra"]["quantization"]["weightBlockSize"] == [16, 16]
    header = (artifact / "model-rank-1-part-0.safetensors").read_bytes()
    assert b'"model.layers.0.mlp.down_proj.weight_scale_inv"' in header and b'"F8_E4M3"' in header

    # 128-row blocks: 8 heads x 16 / 2 = 64 query rows per rank are not whole blocks.
    coarse = ModelCase("fp8-128", fp8_block_config(LLAMA3.config, [128, 128]), "BF16")
    write_checkpoint(tmp_path / "fp8-128", coarse)
    started = time.monotonic()
    crd.apply(modelweights("fp8-128", namespace, f"file://{tmp_path / 'fp8-128'}", format=fmt))
    wait_condition(crd, namespace, "fp8-128", "Stalled")
    stalled = {c["type"]: c for c in crd.get_json("mw", "fp8-128", "-n", namespace)["status"]["conditions"]}["Stalled"]
    assert "not whole 128-wide FP8 scale blocks" in stalled["message"], stalled
    assert "self_attn.q_proj" in stalled["message"] and "after" not in stalled["message"], stalled  # no retries
    assert time.monotonic() - started < 60  # a refusal of the input is not retried with back-off
