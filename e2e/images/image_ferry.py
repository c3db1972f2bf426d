"""ferry.local/ferry:<hash> (and :dev): the operator + worker image that
worker_image/Dockerfile describes, in three cached layers (keys.py):

  base  Debian bookworm minbase + python3, python3-venv, ca-certificates (rootfs.py)
  deps  /opt/ferry/venv with the pinned operator + worker dependencies (python_layers.py)
  app   the project's wheel installed into that venv
and the Dockerfile's final-stage USER, ENV and ENTRYPOINT (dockerfile.py).
"""
from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from images import dockerfile, keys, layers, python_layers, rootfs, sandbox

NAME = "ferry"
REPO_NAME = "ferry.local/ferry"
DEV_REF = f"{REPO_NAME}:dev"
DOCKERFILE = "worker_image/Dockerfile"
# What python:3.11-slim's environment adds to the Dockerfile's own ENV, with the venv first on PATH.
BASE_ENV = {"PATH": f"{python_layers.VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8"}


def key(repo: Path) -> str:
    return keys.ferry_keys(repo).app


def import_packages(repo: Path) -> list[str]:
    """The project's top-level import packages (pyproject's [tool.setuptools] package-dir)."""
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted(setuptools["package-dir"])


def runtime_config(repo: Path, app_key: str) -> dict:
    spec = dockerfile.final_stage(repo / DOCKERFILE)
    version = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"]
    return {"user": spec.user, "env": {**BASE_ENV, **spec.env}, "entrypoint": spec.entrypoint, "cmd": spec.cmd,
            "workdir": spec.workdir,
            "labels": {"org.opencontainers.image.title": NAME, "org.opencontainers.image.version": version,
                       "dev.ferry.image.key": app_key}}


def build(cache, layout, repo: Path, key: str) -> tuple[str, list[str], int]:
    k = keys.ferry_keys(repo)
    assert k.app == key, "project files changed while building"
    base = layers.build_stage(
        cache, layout, "ferry-base", k.base, None, rootfs.make_base, keep_tree=True,
        created_by=f"debootstrap --variant=minbase {rootfs.SUITE} + {' '.join(rootfs.PACKAGES)} (slimmed)")

    def fill_deps(tree: Path) -> None:
        wheels = cache.wheels / k.deps[:32]
        if not (wheels / ".complete").exists():
            shutil.rmtree(wheels, ignore_errors=True)
            python_layers.download_wheels(python_layers.pinned_requirements(repo / "pyproject.toml"), wheels)
            (wheels / ".complete").touch()
        sandbox.run([base.tree], python_layers.deps_commands(), upper=tree, inputs=wheels)

    deps = layers.build_stage(cache, layout, "ferry-deps", k.deps, base.tag, fill_deps, keep_tree=True,
                              created_by=f"pip install (offline) pinned [{','.join(python_layers.EXTRAS)}] "
                                         f"into {python_layers.VENV}")

    def fill_app(tree: Path) -> None:
        build_python = python_layers.ensure_build_env(
            repo / "pyproject.toml",
            cache.buildenv / keys.digest(python_layers.build_requires(repo / "pyproject.toml"))[:16])
        with cache.scratch("ferry-wheel") as scratch:
            source = scratch / "src"
            for path in keys.project_files(repo):  # a clean copy: no stale build/ or egg-info
                dest = source / path.relative_to(repo)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, dest)
            wheel = python_layers.build_app_wheel(source, build_python, scratch / "wheel")
            sandbox.run([deps.tree, base.tree], python_layers.app_commands(wheel.name, import_packages(repo)),
                        upper=tree, inputs=wheel.parent)

    app = layers.build_stage(cache, layout, "ferry-app", k.app, deps.tag, fill_app,
                             created_by=f"pip install --no-deps ferry (this checkout) into {python_layers.VENV}")
    final = layers.configured(layout, app.tag, layers.stage_tag(NAME, k.app), runtime_config(repo, k.app))
    digest = layout.descriptor(final)["digest"].split(":", 1)[1]
    return final, [f"{REPO_NAME}:{digest[:12]}", DEV_REF], base.bytes + deps.bytes + app.bytes
