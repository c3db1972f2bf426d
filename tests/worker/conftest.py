"""Fixtures for the worker tests: a real S3-compatible server process on loopback.

The server is gofakes3, built from the Go module proxy by e2e/s3/build.sh and
cached under ~/.cache/ferry/s3 (or FERRY_S3_SERVER). If it cannot be built or
started the tests fail: nothing here skips silently.
"""
from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "e2e" / "s3"))

from s3server import S3Server  # noqa: E402


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> S3Server:
    """gofakes3 with its filesystem backend: objects stream from disk, ranged GETs honoured."""
    with S3Server(tmp_path_factory.mktemp("s3-fs")) as server:
        yield server


@pytest.fixture(scope="session")
def s3_memory_server(tmp_path_factory: pytest.TempPathFactory) -> S3Server:
    """gofakes3 with its memory backend: holds keys no filesystem could (path traversal tests)."""
    with S3Server(tmp_path_factory.mktemp("s3-mem"), backend="mem") as server:
        yield server


@pytest.fixture
def s3_env(s3_server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """In-process ferry commands find the server the way a Job does: through the AWS environment."""
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    name = f"ferry-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name



@pytest.fixture(scope="session")
def cache_artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three TP 2 sharded_state artifacts of different checkpoints (seeds), as they sit on a claim: real
    `ferry shard` output for the node cache's tests."""
    from checkpoints import LLAMA3, write_checkpoint
    from ferry_worker.shard.job import ShardJob

    root = tmp_path_factory.mktemp("claim")
    out = {}
    for seed in range(3):
        write_checkpoint(root / f"ckpt-{seed}", LLAMA3, seed=seed)
        ShardJob.prepare(root / f"ckpt-{seed}", root / f"artifact-{seed}", tp=2).run()
        out[f"a{seed}"] = root / f"artifact-{seed}"
    return out
