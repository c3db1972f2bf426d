"""The ferry image's Python layers: the pinned third-party dependencies in a
virtualenv, then the project itself.

Wheels come from PyPI on the host (pip, the host's python must be the image's
python version); the image's own pip installs them offline (--no-index) in a
chroot of the rootfs. Byte code is compiled at build time, hash-based and
unchecked, so a read-only root filesystem never needs to write a .pyc.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from images import rootfs

VENV = "/opt/ferry/venv"
SITE = f"{VENV}/lib/python{rootfs.PYTHON}/site-packages"
EXTRAS = ("operator", "worker")
PIP_INSTALL = [f"{VENV}/bin/python", "-m", "pip", "install", "--quiet", "--no-index", "--no-cache-dir",
               "--disable-pip-version-check", "--no-compile", "--no-warn-script-location"]
COMPILE = [f"{VENV}/bin/python", "-m", "compileall", "-q", "-f", "-j0", "--invalidation-mode", "unchecked-hash"]
# Part of the dependency layer's cache key: bump "version" when deps_commands() changes.
DEPS_RECIPE = {"venv": VENV, "extras": EXTRAS, "install": PIP_INSTALL, "compile": COMPILE, "version": 1}
# Where build inputs appear inside the chroot (a read-only bind mount of a host directory).
INPUTS = "/mnt"


def pinned_requirements(pyproject: Path) -> list[str]:
    """The project's dependencies plus those of the operator and worker extras, as pinned in pyproject.toml."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    for extra in EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return sorted(set(reqs), key=str.lower)


def build_requires(pyproject: Path) -> list[str]:
    return list(tomllib.loads(pyproject.read_text())["build-system"]["requires"])


def check_host_python() -> None:
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != rootfs.PYTHON:
        raise SystemExit(f"images: the host python is {have}, the image's is {rootfs.PYTHON}: run build.py with a "
                         f"python{rootfs.PYTHON} (the project's .venv) so pip downloads wheels the image can install")


def download_wheels(requirements: list[str], dest: Path) -> None:
    """Every wheel the pins need (transitively) into dest, with requirements.txt beside them."""
    check_host_python()
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "requirements.txt").write_text("\n".join(requirements) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                    "--wheel-dir", str(dest), "-r", str(dest / "requirements.txt")], check=True)


def deps_commands() -> list[list[str]]:
    """Run in the chroot, inputs (download_wheels' directory) at INPUTS."""
    return [
        ["python3", "-m", "venv", VENV],
        [*PIP_INSTALL, "--find-links", INPUTS, "-r", f"{INPUTS}/requirements.txt"],
        [*COMPILE, SITE],
    ]


def ensure_build_env(pyproject: Path, dest: Path) -> Path:
    """A venv holding the project's build backend (build-system.requires), made once; returns its python."""
    python = dest / "bin" / "python"
    if not (dest / ".complete").exists():
        shutil.rmtree(dest, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(dest)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        *build_requires(pyproject)], check=True)
        (dest / ".complete").touch()
    return python


def build_app_wheel(source: Path, build_python: Path, dest: Path) -> Path:
    """The project's wheel, built from source (a clean copy of the project files) without network."""
    subprocess.run([str(build_python), "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check",
                    "--no-deps", "--no-index", "--no-build-isolation", "--wheel-dir", str(dest), str(source)],
                   check=True, stdout=subprocess.DEVNULL)
    (wheel,) = dest.glob("*.whl")
    return wheel


def app_commands(wheel_name: str, packages: list[str]) -> list[list[str]]:
    """Run in the chroot over the dependency layer, the wheel at INPUTS; packages: the project's import packages."""
    return [
        [*PIP_INSTALL, "--no-deps", f"{INPUTS}/{wheel_name}"],
        [f"{VENV}/bin/python", "-m", "pip", "check", "--disable-pip-version-check"],
        [*COMPILE, *(f"{SITE}/{name}" for name in packages)],
    ]
