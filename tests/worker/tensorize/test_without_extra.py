"""The worker without the tensorize extra: every command but `tensorize` runs,
and `tensorize` says which extra it needs. torch and tensorizer are made
unimportable in a child process (as in an image built without the extra)."""
from __future__ import annotations

import os
import subprocess
import sys

from checkpoints import write_checkpoint
from tensorize_support import QWEN2_TIED, list_keys

BLOCKED = """
import sys
for name in ("torch", "tensorizer"):
    sys.modules[name] = None  # import raises ImportError
from ferry_worker.cli import main
status = main(sys.argv[1:])
assert "torch" not in sys.modules or sys.modules["torch"] is None
sys.exit(status)
"""


def _ferry_without_extra(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKED, *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=120)


def test_publish_and_delete_run_without_torch(s3_server, bucket, tmp_path):
    write_checkpoint(tmp_path / "ckpt", QWEN2_TIED)
    proc = _ferry_without_extra("publish", "--source", str(tmp_path / "ckpt"), "--output", f"s3://{bucket}/p",
                                env=s3_server.env())
    assert proc.returncode == 0, proc.stderr
    assert "ferry-manifest.json" in list_keys(s3_server.client(), bucket, "p")
    assert _ferry_without_extra("verify", f"s3://{bucket}/p", env=s3_server.env()).returncode == 0
    assert _ferry_without_extra("delete-artifact", f"s3://{bucket}/p", env=s3_server.env()).returncode == 0
    assert _ferry_without_extra("tensorize", "--help").returncode == 0


def test_tensorize_names_the_missing_extra(tmp_path):
    write_checkpoint(tmp_path / "ckpt", QWEN2_TIED)
    proc = _ferry_without_extra("tensorize", "--source", str(tmp_path / "ckpt"), "--output", str(tmp_path / "out"))
    assert proc.returncode == 1
    assert "needs torch and tensorizer (pip install 'ferry[tensorize]')" in proc.stderr
    assert not (tmp_path / "out").exists()
