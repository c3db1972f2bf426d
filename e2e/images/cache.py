"""Where built images live, and the lock that lets one build at a time use it.

    ${FERRY_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ferry}/images/
      oci/                  one OCI image layout (umoci): every stage of every image, tagged by stage key
      layers/<stage>-<key>/ a stage's layer as a directory tree (the lower layers of the next stage)
      stages/<stage>-<key>.json  written last: the stage is complete
      records/<name>-<key>.json  a finished image: refs, manifest digest, archive, sizes
      archives/<name>-<digest>.tar  what `ctr images import` reads (only the newest per image is kept)
      wheels/<key>/         third-party wheels downloaded on the host
      buildenv/<key>/       a venv with the project's build backend (builds the ferry wheel)
      work/                 scratch for builds in progress
      latest.json           name -> {"ref", "refs", "digest", "archive", ...} of the last build
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def root() -> Path:
    """${FERRY_CACHE:-${XDG_CACHE_HOME:-~/.cache}/ferry}/images, as e2e/s3/build.sh and friends."""
    if os.environ.get("FERRY_CACHE"):
        return Path(os.environ["FERRY_CACHE"]) / "images"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ferry" / "images"


class Cache:
    def __init__(self, path: Path | None = None):
        self.path = path or root()
        self.layout = self.path / "oci"
        self.layers = self.path / "layers"
        self.stages = self.path / "stages"
        self.records = self.path / "records"
        self.archives = self.path / "archives"
        self.wheels = self.path / "wheels"
        self.buildenv = self.path / "buildenv"
        self.work = self.path / "work"
        self.latest = self.path / "latest.json"

    @contextmanager
    def locked(self):
        """Hold the cache's lock: concurrent builds (make images, a test, a harness) queue here."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / ".lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield self
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    @contextmanager
    def scratch(self, prefix: str):
        """A fresh directory under work/ (same filesystem as layers/, so it can be renamed there), removed after."""
        self.work.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=prefix + "-", dir=self.work))
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_json(path: Path, data: dict) -> None:
    """Atomically (write then rename): a crash never leaves half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
