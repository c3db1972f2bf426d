"""ferry.local/busybox:<version>: Debian's static busybox (busybox-static) with
a link per applet (/bin/sh, mkdir, rm, chmod, ...). rancher's
local-path-provisioner runs its helper pods on it (`sh -c 'mkdir -m 0777 ...'`)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from images import elf, keys, layers

NAME = "busybox"
BINARY = Path("/bin/busybox")  # Debian package busybox-static
CONFIG = {"cmd": ["sh"], "env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}}
PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
GROUP = "root:x:0:\nnobody:x:65534:\n"


def _check_binary() -> None:
    if not BINARY.exists() or not elf.is_static(BINARY.resolve()):
        raise SystemExit(f"images: {BINARY} must be a static busybox: apt-get install busybox-static")


def version() -> str:
    _check_binary()
    banner = subprocess.run([str(BINARY)], capture_output=True, text=True).stdout
    match = re.match(r"BusyBox v(\d+(?:\.\d+)+)", banner)
    if not match:
        raise SystemExit(f"images: cannot read busybox's version from {banner[:80]!r}")
    return match.group(1)


def key(repo: Path) -> str:
    _check_binary()
    return keys.digest(NAME, keys.file_digest(BINARY), keys.builder_digest("image_busybox.py"))


def _fill(tree: Path) -> None:
    for name, mode in (("bin", 0o755), ("sbin", 0o755), ("usr/bin", 0o755), ("usr/sbin", 0o755), ("etc", 0o755),
                       ("root", 0o700), ("tmp", 0o1777), ("var", 0o755), ("proc", 0o755), ("sys", 0o755),
                       ("dev", 0o755)):
        (tree / name).mkdir(parents=True, exist_ok=True)
        os.chmod(tree / name, mode)
    shutil.copy2(BINARY.resolve(), tree / "bin/busybox")
    applets = subprocess.run([str(BINARY), "--list-full"], check=True, capture_output=True, text=True).stdout.split()
    for applet in applets:
        if applet != "bin/busybox":
            (tree / applet).symlink_to("/bin/busybox")
    (tree / "etc/passwd").write_text(PASSWD)
    (tree / "etc/group").write_text(GROUP)


def build(cache, layout, repo: Path, key: str) -> tuple[str, list[str], int]:
    layer = layers.build_stage(cache, layout, "busybox-layer", key, None, _fill,
                               created_by=f"{BINARY} (busybox-static) + busybox --list-full links")
    refs = [f"ferry.local/busybox:{version()}"]
    return layers.configured(layout, layer.tag, layers.stage_tag(NAME, key), CONFIG), refs, layer.bytes
