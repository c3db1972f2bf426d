"""Stages: an image grows one cached layer at a time.

A stage is (name, key, parent tag, a function that fills a directory). Its
directory tree becomes one layer on top of the parent (oci.Layout.add_layer)
under the tag "<name>-<key>"; a stage that later stages build on keeps its
tree under layers/ so they can stack it (sandbox.run lowers) without
unpacking anything. stages/<name>-<key>.json, written last, says it is done.
"""
from __future__ import annotations

import os
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from images import cache as cache_mod
from images.oci import Layout


@dataclass(frozen=True)
class Stage:
    tag: str
    tree: Path | None  # kept only when asked (keep_tree)
    bytes: int  # size of the layer's files, unpacked


def stage_tag(name: str, key: str) -> str:
    return f"{name}-{key[:32]}"


def build_stage(cache: cache_mod.Cache, layout: Layout, name: str, key: str, parent: str | None,
                fill: Callable[[Path], None], *, keep_tree: bool = False, created_by: str = "") -> Stage:
    """The stage's tag in the layout, built unless the cache already holds it.

    parent: the tag to add the layer to (None: an empty image); fill(tree)
    populates the empty directory tree with the layer's contents.
    """
    tag = stage_tag(name, key)
    marker = cache.stages / f"{tag}.json"
    kept = cache.layers / tag
    done = cache_mod.read_json(marker)
    if done and layout.has(tag) and (not keep_tree or kept.is_dir()):
        return Stage(tag, kept if keep_tree else None, done["bytes"])
    log(f"{name}: building layer {tag}")
    started = time.monotonic()
    with cache.scratch(name) as scratch:
        tree = scratch / "tree"
        tree.mkdir(mode=0o755)
        fill(tree)
        prepare_tree(tree)
        size = tree_bytes(tree)
        if parent is None:
            layout.new(tag)
            parent = tag
        layout.add_layer(parent, tree, tag, created_by or f"ferry e2e/images: {name}")
        if keep_tree:
            cache.layers.mkdir(parents=True, exist_ok=True)
            if kept.exists():
                os.rename(kept, scratch / "stale")  # removed with the scratch dir
            os.rename(tree, kept)
    cache_mod.write_json(marker, {"tag": tag, "key": key, "bytes": size, "tree": str(kept) if keep_tree else None,
                                  "seconds": round(time.monotonic() - started, 1)})
    log(f"{name}: layer {tag} built in {time.monotonic() - started:.1f}s ({size / 1e6:.1f} MB)")
    return Stage(tag, kept if keep_tree else None, size)


def prepare_tree(tree: Path) -> None:
    """Make an overlay upper dir a plain tree: drop overlayfs' own xattrs; refuse
    whiteouts (none of our steps deletes a lower file; a layer would need them
    converted to .wh. entries)."""
    os.chown(tree, 0, 0)
    os.chmod(tree, 0o755)  # the layer's "/" entry
    for dirpath, dirnames, filenames in os.walk(tree):
        for entry in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            st = os.lstat(entry)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                raise RuntimeError(f"layer {tree}: {entry} is an overlay whiteout (a step deleted a lower file)")
            for attr in os.listxattr(entry, follow_symlinks=False):
                if attr == "trusted.overlay.opaque":
                    raise RuntimeError(f"layer {tree}: {entry} is an opaque overlay directory")
                if attr.startswith("trusted.overlay."):
                    os.removexattr(entry, attr, follow_symlinks=False)


def tree_bytes(tree: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(tree):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
    return total


def log(message: str) -> None:
    print(f"[images] {message}", file=sys.stderr, flush=True)


def configured(layout: Layout, tag: str, final_tag: str, config: dict) -> str:
    """final_tag = tag with the runtime config (user, env, entrypoint, ...; see Layout.configure)."""
    if not layout.has(final_tag):
        layout.configure(tag, final_tag, **config)
    return final_tag
