"""ferry.local/pause:3.10, the pod sandbox image: one static binary, /pause (pause.c)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from images import keys, layers

NAME = "pause"
REFS = ["ferry.local/pause:3.10"]
SOURCE = keys.HERE / "pause.c"
CFLAGS = ["-static", "-O2", "-s", "-Wall", "-Wextra", "-Werror"]
# As registry.k8s.io/pause: a nobody user; the runtime only ever signals it.
CONFIG = {"user": "65535:65535", "entrypoint": ["/pause"],
          "env": {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}}


def key(repo: Path) -> str:
    return keys.digest(NAME, keys.file_digest(SOURCE), CFLAGS, keys.gcc_version(),
                       keys.builder_digest("image_pause.py", "pause.c"))


def _fill(tree: Path) -> None:
    subprocess.run(["gcc", *CFLAGS, "-o", str(tree / "pause"), str(SOURCE)], check=True)


def build(cache, layout, repo: Path, key: str) -> tuple[str, list[str], int]:
    layer = layers.build_stage(cache, layout, "pause-layer", key, None, _fill,
                               created_by=f"gcc {' '.join(CFLAGS)} pause.c -o /pause")
    return layers.configured(layout, layer.tag, layers.stage_tag(NAME, key), CONFIG), REFS, layer.bytes
