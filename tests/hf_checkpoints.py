"""Checkpoints written by transformers' own modelling code (tests/worker/shard/hf_generate.py, in the
vLLM venv), once per session: the session fixture `hf_checkpoints` (tests/conftest.py) holds one store.

A case is hf_generate.py's CASE argument (a family name or a JSON object); the same case always names
the same bytes (hf_generate seeds each build), so the shard and tensorize breadth suites share the
families' checkpoints instead of writing each twice. Every case a suite asks for that the store lacks
is written by one hf_generate.py process: torch and transformers are imported once, not per case.
Suites treat the directories as read-only.
"""
from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest

HF_GENERATE = Path(__file__).resolve().parent / "worker" / "shard" / "hf_generate.py"


class HfCheckpoints:
    def __init__(self, vllm_python: str, root: Path, env: dict[str, str]) -> None:
        self.vllm_python, self.root, self.env = vllm_python, root, env
        self.written: dict[str, Path] = {}

    def directory(self, case: str) -> Path:
        """Where `case` is (or will be) written: named after it, unique per case."""
        label = case if case.replace("_", "").isalnum() else "case"
        return self.root / f"{label}-{hashlib.sha256(case.encode()).hexdigest()[:10]}"

    def ensure(self, cases: list[str]) -> dict[str, Path]:
        """Each case's checkpoint directory, writing the missing ones in one process."""
        missing = list(dict.fromkeys(c for c in cases if c not in self.written))
        if missing:
            argv = [self.vllm_python, str(HF_GENERATE)]
            for case in missing:
                argv += [str(self.directory(case)), case]
            proc = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=300 + 120 * len(missing))
            if proc.returncode != 0:
                pytest.fail(f"hf_generate.py {' '.join(missing)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
            self.written.update((case, self.directory(case)) for case in missing)
        return {case: self.written[case] for case in cases}
