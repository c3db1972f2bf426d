"""Greedy tokens of real vLLM runs, and how tests compare them with a reference.

The prompts (token ids) and length every vLLM test generates; the reference
run of tests/worker/shard/vllm_generate.py (vLLM's LLM, load_format `auto`,
on the ORIGINAL checkpoint) started beside a server; and the comparison of
greedy tokens with a TP 1 reference that allows numerical near-ties, used by
test_shard_vllm.py and test_vllm_weights_loaded.py; and the session's store of
those references (ReferenceStore, the `vllm_references` fixture): one run per
(checkpoint bytes, TP size) per session, whichever suites compare against it.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_server import group_alive, stop_group

GENERATE = Path(__file__).resolve().parent / "worker" / "shard" / "vllm_generate.py"
PROMPTS = [[5, 17, 300], [999, 4], [7], [100, 200, 300, 400], [42, 42, 42], [640, 1, 960]]
MAX_TOKENS = 16
# A top-2 log-prob gap below this is a numerical tie between TP 1 and TP 2
# (bf16 logits here are quantized to 1/16..1/4 and differ by up to 1/4).
NEAR_TIE_NATS = 0.5


@dataclass
class ReferenceRun:
    """vllm_generate.py running (in a session of its own) on the original checkpoint, one run per TP size."""
    proc: subprocess.Popen
    root: Path  # holds its stdout and stderr files
    tps: list[int]
    parsed: dict[int, dict] = field(default_factory=dict)  # its results, once read (every suite asks)
    WAIT_S = 900

    def results(self, name: str = "the reference") -> dict[int, dict]:
        """Wait for it (at most WAIT_S), then each TP size's result (`tokens`, `top2` per prompt);
        fails the test unless it exited 0 with one result per TP size."""
        if self.parsed:
            return self.parsed
        try:
            self.proc.wait(self.WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        stdout, stderr = (self.root / "stdout").read_text(), (self.root / "stderr").read_text()
        lines = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
        if self.proc.returncode != 0 or len(lines) != len(self.tps):
            pytest.fail(f"{name} exited {self.proc.returncode}:\n{stdout[-4000:]}\n{stderr[-8000:]}")
        self.parsed = {tp: json.loads(line) for tp, line in zip(self.tps, lines)}
        return self.parsed

    def stop(self) -> None:
        """Stop whatever of it still runs; fails if anything of its process group survives."""
        left = stop_group(self.proc) if self.proc.poll() is None or group_alive(self.proc.pid) else []
        assert not left, f"the reference left processes: {left}"


def start_reference(vllm_python: str, original: Path, tps: list[int], root: Path,
                    env: dict[str, str]) -> ReferenceRun:
    """Start vllm_generate.py on `original` (load_format auto, dtype auto, PP 1) at each TP size in `tps`,
    greedy over PROMPTS for MAX_TOKENS, without waiting for it: it can run beside a server."""
    spec = [{"model": str(original), "load_format": "auto", "tp": tp, "pp": 1, "dtype": "auto",
             "prompts": PROMPTS, "max_tokens": MAX_TOKENS} for tp in tps]
    with open(root / "stdout", "w") as out, open(root / "stderr", "w") as err:
        proc = subprocess.Popen([vllm_python, str(GENERATE), json.dumps(spec)], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, env=env, cwd=root, start_new_session=True)
    return ReferenceRun(proc, root, list(tps))


def checkpoint_digest(directory: Path) -> str:
    """sha256 over a checkpoint directory's files (name and bytes, in name order): what the reference ran on."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


class ReferenceStore:
    """The session's references (fixture `vllm_references`): vllm_generate.py on an original checkpoint at a
    TP size, keyed by the checkpoint's bytes (checkpoint_digest) and the TP size. The first suite to ask
    starts the run (beside its own server, as start_reference does); later suites get the same run's result.
    The same comparisons against the same real vLLM, computed once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs: dict[tuple[str, int], ReferenceRun] = {}

    def start(self, vllm_python: str, original: Path, tps: list[int], env: dict[str, str]) -> "SharedReference":
        digest = checkpoint_digest(original)
        missing = [tp for tp in tps if (digest, tp) not in self.runs]
        if missing:
            root = self.root / f"{digest[:12]}-tp{'-'.join(map(str, missing))}"
            root.mkdir()
            run = start_reference(vllm_python, original, missing, root, env)
            self.runs.update({(digest, tp): run for tp in missing})
        return SharedReference(self, digest, list(tps))

    def stop(self) -> None:
        for run in {id(r): r for r in self.runs.values()}.values():
            run.stop()


@dataclass
class SharedReference:
    """One suite's view of the store: the TP sizes it compares against."""
    store: ReferenceStore
    digest: str
    tps: list[int]

    def results(self, name: str = "the reference") -> dict[int, dict]:
        return {tp: self.store.runs[(self.digest, tp)].results(name)[tp] for tp in self.tps}


CPU_ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
                  # collective_rpc ships the comparison functions to the workers.
                  "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def vllm_cache_root() -> str:
    """vLLM's cache directory as vLLM finds it from this environment (VLLM_CACHE_ROOT, else
    $XDG_CACHE_HOME/vllm or ~/.cache/vllm). A run that moves HOME passes it on, so vLLM still finds the model
    facts it cached there (modelinfos/): without them each engine start inspects the model class in a
    subprocess of its own (~5 s here)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return os.environ.get("VLLM_CACHE_ROOT") or str(Path(cache) / "vllm")


def run_engines(vllm_python: str, script: Path, specs: list[dict], *, env: dict[str, str], cwd: Path,
                timeout: int) -> list:
    """Run `script` (vllm_generate.py, vllm_tensorizer.py) on `specs` in one vLLM process; its
    `RESULT {json}` line per spec, or the test fails with the process's output."""
    proc = subprocess.run([vllm_python, str(script), json.dumps(specs)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)
    lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != len(specs):
        pytest.fail(f"vLLM exited {proc.returncode} after {len(lines)} of {len(specs)} runs:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return [json.loads(line) for line in lines]


def assert_reference_varies(prompt: list[int], ref_tokens: list[int]) -> None:
    """The generated fixture model's greedy continuation is not a repetition (else equal tokens prove little)."""
    assert len(set(ref_tokens)) > MAX_TOKENS // 4, f"prompt {prompt}: the fixture model just repeats itself"


def assert_greedy_tokens_match(reference: dict, tokens: list[list[int]], candidate: str,
                               require_variety: bool = True) -> None:
    """Greedy tokens for PROMPTS (`tokens`, MAX_TOKENS each) equal the TP 1 reference's (vllm_generate.py:
    `tokens` and each step's `top2` (token, log-prob)) up to numerical ties: where a prompt's tokens part,
    the reference's best two were within NEAR_TIE_NATS and `candidate` took the runner-up. At least two
    prompts match entirely."""
    whole_matches = 0
    for prompt, ref_tokens, ref_top2, got in zip(PROMPTS, reference["tokens"], reference["top2"], tokens):
        assert len(got) == len(ref_tokens) == MAX_TOKENS, (prompt, got)
        if require_variety:
            assert_reference_varies(prompt, ref_tokens)
        parted = next((step for step, (a, b) in enumerate(zip(ref_tokens, got)) if a != b), None)
        if parted is None:
            whole_matches += 1
            continue
        (best, best_lp), (runner_up, runner_up_lp) = ref_top2[parted]
        assert best_lp - runner_up_lp < NEAR_TIE_NATS and got[parted] == runner_up, (
            f"prompt {prompt}: {candidate} chose {got[parted]} at step {parted} where TP 1 chose {best} by "
            f"{best_lp - runner_up_lp:.3f} nats over {runner_up}: not a numerical tie\n"
            f"TP 1: {ref_tokens}\n{candidate}: {got}")
    assert whole_matches >= 2, f"only {whole_matches} of {len(PROMPTS)} prompts matched entirely"


def assert_workers_built_the_same_state(workers: list[dict], ranks: int = 2) -> None:
    """Each worker's state from vLLM's default loader (`default`: key -> [shape,
    dtype, sha256]) equals the one ShardedStateLoader built from Ferry's
    artifact (`sharded`), key for key and byte for byte, on every rank."""
    assert sorted(w["tp_rank"] for w in workers) == list(range(ranks))
    for worker in workers:
        default, sharded = worker["default"], worker["sharded"]
        assert sorted(sharded) == sorted(default), worker["tp_rank"]
        differing = [k for k in default if default[k] != sharded[k]]
        assert not differing, f"tp {worker['tp_rank']}: differ from vLLM's own load: {differing}"
