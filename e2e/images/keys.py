"""Cache keys: a content hash of everything that shapes a stage's bytes.

The ferry image has three stages, each keyed by its inputs and its parent's key:
  base = H(rootfs.RECIPE, architecture)                 debootstrap: minutes
  deps = H(base, pinned requirements, DEPS_RECIPE)      pip into the venv: ~half a minute
  app  = H(deps, project files, this builder's source)  the project's wheel: seconds
so a change to the project's Python code changes only the app key. The cheap
images (pause, busybox) hash their inputs and this builder's source.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from images import python_layers, rootfs

HERE = Path(__file__).resolve().parent
# What goes into the ferry wheel (the files worker_image/Dockerfile COPYs).
PROJECT_FILES = ("pyproject.toml", "README.md", "operator", "worker_image")
_SKIP_DIRS = {"__pycache__", "build", "dist", ".pytest_cache"}


def digest(*parts) -> str:
    """sha256 hex of JSON-serializable parts."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def project_files(repo: Path, tops=PROJECT_FILES) -> list[Path]:
    """The files under tops (relative to repo), sorted; build outputs and byte code left out."""
    files = []
    for top in tops:
        path = repo / top
        if path.is_file():
            files.append(path)
            continue
        for item in path.rglob("*"):
            rel = item.relative_to(repo)
            if any(part in _SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
                continue
            if item.is_file() and item.suffix not in (".pyc", ".pyo"):
                files.append(item)
    return sorted(files)


def tree_digest(repo: Path, files: list[Path]) -> str:
    """sha256 over each file's path, executable bit and content."""
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(repo)).encode() + b"\0")
        h.update(b"x" if path.stat().st_mode & 0o111 else b"-")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# The builder files every image's bytes go through (layer tars, configs, archives).
COMMON_BUILDER_FILES = ("layers.py", "oci.py")


def builder_digest(*files: str) -> str:
    """The builder's own source that shapes an image: its recipe files plus the
    common ones. Changing them rebuilds the cheap stages (not base or deps:
    those have explicit recipes, see rootfs.RECIPE and python_layers.DEPS_RECIPE)."""
    return tree_digest(HERE, sorted(HERE / name for name in {*files, *COMMON_BUILDER_FILES}))


@lru_cache(maxsize=None)
def architecture() -> str:
    return rootfs.architecture()


@dataclass(frozen=True)
class FerryKeys:
    base: str
    deps: str
    app: str


def ferry_keys(repo: Path) -> FerryKeys:
    base = digest("base", rootfs.RECIPE, architecture())
    deps = digest("deps", base, python_layers.pinned_requirements(repo / "pyproject.toml"),
                  python_layers.DEPS_RECIPE)
    app = digest("app", deps, tree_digest(repo, project_files(repo)),
                 builder_digest("image_ferry.py", "python_layers.py", "dockerfile.py", "sandbox.py"))
    return FerryKeys(base, deps, app)


def gcc_version() -> str:
    return subprocess.run(["gcc", "-dumpfullversion"], check=True, capture_output=True, text=True).stdout.strip()
