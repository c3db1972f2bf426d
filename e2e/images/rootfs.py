"""The ferry image's base layer: a Debian root filesystem made by debootstrap.

What the layer holds is fixed by RECIPE (part of the base layer's cache key):
bump "version" whenever make_base() changes what it produces.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SUITE = "bookworm"
PYTHON = "3.11"  # bookworm's python3; the host's pip downloads wheels for it
PACKAGES = ("python3", "python3-venv", "ca-certificates")
# The non-root user the image runs as (worker_image/Dockerfile: USER 65532:65532).
NONROOT = (65532, "nonroot")
RECIPE = {"suite": SUITE, "variant": "minbase", "packages": sorted(PACKAGES), "python": PYTHON,
          "nonroot": NONROOT, "version": 1}
MIRROR = os.environ.get("FERRY_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# debootstrap checks the Release file's signature only when it finds a keyring: insist on one.
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")

# Like debian:bookworm-slim (which python:3.11-slim builds on): no man pages,
# translations or docs besides copyright files, now and for later dpkg installs.
DPKG_EXCLUDES = """\
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
"""


def architecture() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], check=True, capture_output=True, text=True).stdout.strip()


def make_base(dest: Path, packages: tuple[str, ...] = PACKAGES) -> None:
    """debootstrap into dest (an empty directory) with packages, then slim it into a container root filesystem."""
    if not KEYRING.exists():
        raise SystemExit(f"images: {KEYRING} is missing: apt-get install debian-archive-keyring")
    # A private mount namespace: whatever debootstrap mounts (/proc, /sys in the
    # target) disappears with it, even if it fails half way.
    subprocess.run(["unshare", "--mount", "--propagation", "private",
                    "debootstrap", "--variant=minbase", f"--keyring={KEYRING}", f"--include={','.join(packages)}",
                    SUITE, str(dest), MIRROR], check=True, stdout=subprocess.DEVNULL)
    slim(dest)


def slim(root: Path) -> None:
    """Drop what a container never uses, and what belongs to the build host."""
    # Files only: apt and dpkg expect their directories (var/log/apt, .../partial).
    for top in ("var/cache/apt", "var/lib/apt/lists", "var/log", "run", "tmp"):
        _remove_files(root / top, keep=lambda path: False)
    for top in ("usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/doc"):
        _remove_files(root / top, keep=lambda path: path.name in ("copyright", "locale.alias"))
        _remove_empty_dirs(root / top)
    for path in (root / "dev").iterdir():  # the runtime provides /dev
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    for name in ("etc/hostname", "etc/resolv.conf", "etc/machine-id"):  # copied from the build host
        (root / name).unlink(missing_ok=True)
    (root / "etc/dpkg/dpkg.cfg.d/excludes").write_text(DPKG_EXCLUDES)
    os.chmod(root / "tmp", 0o1777)
    uid, name = NONROOT
    with open(root / "etc/passwd", "a") as passwd:
        passwd.write(f"{name}:x:{uid}:{uid}:{name}:/tmp:/usr/sbin/nologin\n")
    with open(root / "etc/group", "a") as group:
        group.write(f"{name}:x:{uid}:\n")


def _remove_files(top: Path, keep) -> None:
    for path in top.rglob("*"):
        if (path.is_symlink() or not path.is_dir()) and not keep(path):
            path.unlink()


def _remove_empty_dirs(top: Path) -> None:
    for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
