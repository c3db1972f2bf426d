"""Run the local S3-compatible server (gofakes3, built by build.sh) on a loopback port.

    with S3Server(tmp_path / "s3") as s3:
        client = s3.client()
        subprocess.run([...], env={**os.environ, **s3.env()})

`backend="fs"` keeps objects as files under `root` (streamed from disk, so
multi-GiB objects cost no memory); `backend="mem"` keeps them in memory and
accepts keys no filesystem can hold, such as "prefix/../../etc/passwd".
Used by the worker tests (tests/worker/conftest.py) and bench/fetch_s3.py.
"""
from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ACCESS_KEY = "ferry-test"
SECRET_KEY = "ferry-test-secret"
REGION = "us-east-1"


def server_binary() -> str:
    out = subprocess.run(["bash", str(HERE / "build.sh")], check=True, stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, root: Path, backend: str = "fs", host: str = "127.0.0.1", port: int | None = None) -> None:
        # host: loopback, or an address on the local cluster's bridge for pods.
        if backend not in ("fs", "mem"):
            raise ValueError(f"backend must be fs or mem, not {backend!r}")
        self.root = root
        self.backend = backend
        self.host = host
        self.port = port  # None: any free one
        self.endpoint = ""
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 15.0) -> None:
        binary = server_binary()
        self.root.mkdir(parents=True, exist_ok=True)
        log = self.root / "server.log"
        for _ in range(3):  # another process may take the port between probe and bind
            port = self.port or _free_port(self.host)
            argv = [binary, "-host", f"{self.host}:{port}", "-backend", self.backend]
            if self.backend == "fs":
                argv += ["-fs.path", str(self.root / "data"), "-fs.create"]
            with open(log, "ab") as out:
                self._process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
            if self._wait_ready(port, timeout_s):
                self.endpoint = f"http://{self.host}:{port}"
                return
            self.stop()
        raise RuntimeError(f"the S3 server did not start; see {log}:\n{log.read_text()[-2000:]}")

    def _wait_ready(self, port: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is None or self._process.poll() is not None:
                return False
            try:
                with socket.create_connection((self.host, port), timeout=0.5):
                    return True
            except OSError:
                time.sleep(0.05)
        return False

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def env(self) -> dict[str, str]:
        """The environment a `ferry` process (or any AWS SDK) needs to use this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, **config: Any) -> Any:
        import boto3
        from botocore.config import Config

        # gofakes3 also returns an object's stored full-object checksum on ranged
        # GETs, which botocore would then check against the part: let callers
        # validate checksums themselves.
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, response_checksum_validation="when_required", **config),
        )
