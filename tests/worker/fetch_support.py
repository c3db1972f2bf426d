"""Helpers shared by the fetch tests: run the CLI as a process, put a tree into a bucket."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


def run_ferry(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """The `ferry` CLI in a child process, as a prepare Job runs it."""
    return subprocess.run(
        [sys.executable, "-m", "ferry_worker.cli", *args],
        env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )


def upload_tree(client: Any, bucket: str, prefix: str, files: dict[str, bytes], **put_args: Any) -> None:
    for rel, data in files.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{rel}" if prefix else rel, Body=data, **put_args)
