"""The integrity manifest: what "complete" means for a prepared directory.

Every output file is written under a temporary name, fsynced and renamed into
place (`atomic_file`); `ferry-manifest.json` (file, size and digest for each)
is written last, the same way. A directory without a manifest is incomplete,
and `verify` re-checks every file listed in one.

A file's digest is one of two forms, and a reader accepts either (or both,
as the release before this one wrote for rank files):
- `sha256`: of the whole file (fetched and copied files);
- `blocks`: the sha256 of each `blockSize` block, the last one shorter
  (`ferry shard`'s rank files). Each byte is hashed once, and a reader can
  check one large file on every core at once. Integrity is the same: the
  manifest's own digest, which the serving Deployment is wired for, covers
  the block list.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Iterator

from . import __version__

MANIFEST_NAME = "ferry-manifest.json"
MANIFEST_VERSION = 1
TMP_MARKER = ".ferry-tmp"
HASH_CHUNK = 8 << 20
# Block digests (sharded_state rank files): `ferry load` verifies one large
# file on several cores at once, block by block, instead of one sequential sha256.
BLOCK_SIZE = 64 << 20


class IntegrityError(Exception):
    """A file is missing, has the wrong size or the wrong content."""


_DIGEST = re.compile(r"[0-9a-f]{64}")


def block_count(size: int) -> int:
    """Blocks of a file of `size` bytes: an empty file has one, the digest of nothing."""
    return max(1, -(-size // BLOCK_SIZE))


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    sha256: str | None = None  # of the whole file, when recorded
    # sha256 of each BLOCK_SIZE block, the last one shorter; empty when not recorded.
    blocks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.sha256 and not self.blocks:
            raise IntegrityError(f"{self.path}: the manifest records neither a sha256 nor block digests for it")
        for digest in ([self.sha256] if self.sha256 else []) + list(self.blocks):
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise IntegrityError(f"{self.path}: {digest!r} in the manifest is not a sha256 (64 hex digits)")
        if self.blocks and len(self.blocks) != block_count(self.size):
            raise IntegrityError(f"{self.path}: {len(self.blocks)} block digests in the manifest for {self.size} "
                                 f"bytes in blocks of {BLOCK_SIZE}; {block_count(self.size)} expected")

    def to_dict(self) -> dict:
        body: dict = {"path": self.path, "size": self.size}
        if self.sha256:
            body["sha256"] = self.sha256
        if self.blocks:
            body["blocks"] = list(self.blocks)
        return body

    @classmethod
    def from_dict(cls, body: dict, block_size: object) -> "FileEntry":
        path = body.get("path")
        if not isinstance(path, str) or not isinstance(body.get("size"), int):
            raise IntegrityError(f"manifest file entry {json.dumps(body)[:200]}: needs a path and an integer size")
        sha256, blocks = body.get("sha256"), tuple(body.get("blocks") or ())
        if blocks and block_size != BLOCK_SIZE:
            if not sha256:
                raise IntegrityError(f"{path}: only block digests in the manifest, of blockSize {block_size!r}; "
                                     f"this release checks blocks of {BLOCK_SIZE} bytes")
            blocks = ()  # another block size: the whole-file sha256 still checks it
        return cls(path, body["size"], sha256, blocks)


class BlockHasher:
    """sha256 of each block of the bytes fed in order: every byte hashed once."""

    def __init__(self, block_size: int | None = None) -> None:
        self.block_size = block_size or BLOCK_SIZE  # read at call time (tests shrink it)
        self._block = hashlib.sha256()
        self._filled = 0
        self._blocks: list[str] = []

    def update(self, data: memoryview | bytes) -> None:
        data = memoryview(data)
        while len(data):
            take = min(len(data), self.block_size - self._filled)
            self._block.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.block_size:
                self._blocks.append(self._block.hexdigest())
                self._block, self._filled = hashlib.sha256(), 0

    def result(self) -> tuple[str, ...]:
        """The block digests; one (of nothing) for no bytes at all."""
        if self._filled or not self._blocks:
            return (*self._blocks, self._block.hexdigest())
        return tuple(self._blocks)


def block_mismatch(entry: FileEntry, index: int, digest: str) -> IntegrityError:
    start = index * BLOCK_SIZE
    end = min(entry.size, start + BLOCK_SIZE)
    return IntegrityError(f"{entry.path}: block {index} (bytes {start}-{end - 1}) has sha256 {digest}, "
                          f"the manifest says {entry.blocks[index]}")


class ContentCheck:
    """A file's bytes, fed in order, against its manifest entry: its block digests when recorded, else its
    sha256. `whole` also computes the whole file's sha256 when only blocks are recorded (a second hash:
    for a caller that must hand it on, e.g. to a store that checks its own read against it)."""

    def __init__(self, entry: FileEntry, whole: bool = False) -> None:
        self.entry = entry
        self._blocks = BlockHasher() if entry.blocks else None
        self._whole = hashlib.sha256() if (whole or not entry.blocks) else None

    def update(self, data: memoryview | bytes) -> None:
        if self._blocks is not None:
            self._blocks.update(data)
        if self._whole is not None:
            self._whole.update(data)  # releases the GIL on large buffers

    def finish(self) -> str | None:
        """Raise IntegrityError naming the file (and block) unless the bytes match; the whole-file sha256
        when it was computed."""
        if self._blocks is not None:
            blocks = self._blocks.result()
            if len(blocks) != len(self.entry.blocks):
                raise IntegrityError(f"{self.entry.path}: {len(blocks)} blocks read, the manifest has "
                                     f"{len(self.entry.blocks)}")
            for index, (got, want) in enumerate(zip(blocks, self.entry.blocks)):
                if got != want:
                    raise block_mismatch(self.entry, index, got)
        digest = self._whole.hexdigest() if self._whole is not None else None
        if digest is not None and self.entry.sha256 and digest != self.entry.sha256:
            raise IntegrityError(f"{self.entry.path}: sha256 {digest} != {self.entry.sha256} in manifest")
        return digest


@dataclass
class Manifest:
    files: list[FileEntry]
    source: str = ""
    revision: str | None = None
    format: str = "safetensors"
    tool: str = f"ferry {__version__}"
    created_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    # Format-specific facts (e.g. tensorParallelSize, vllmVersion for sharded_state).
    extra: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = {
            "manifestVersion": MANIFEST_VERSION,
            "tool": self.tool,
            "createdAt": self.created_at,
            "source": self.source,
            "revision": self.revision,
            "format": self.format,
            "totalBytes": self.total_bytes,
            "extra": self.extra,
            "files": [f.to_dict() for f in sorted(self.files, key=lambda f: f.path)],
        }
        if any(f.blocks for f in self.files):
            body["blockSize"] = BLOCK_SIZE
        return (json.dumps(body, indent=2, sort_keys=False) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        body = json.loads(data)
        if body.get("manifestVersion") != MANIFEST_VERSION:
            raise IntegrityError(f"unsupported manifest version {body.get('manifestVersion')!r}")
        return cls(
            files=[FileEntry.from_dict(f, body.get("blockSize")) for f in body["files"]],
            source=body.get("source", ""),
            revision=body.get("revision"),
            format=body.get("format", "safetensors"),
            tool=body.get("tool", ""),
            created_at=body.get("createdAt", ""),
            extra=body.get("extra", {}),
        )


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])  # hashlib releases the GIL on large buffers
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(final: Path) -> Path:
    # Per process and thread: two threads writing one file (the node agent's metadata) never share one.
    return final.with_name(f".{final.name}{TMP_MARKER}-{os.getpid()}-{threading.get_ident()}")


def partial_name(final: Path) -> Path:
    """Where a resumable transfer of `final` accumulates: stable across runs, unlike tmp_name."""
    return final.with_name(f".{final.name}{TMP_MARKER}-partial")


@contextlib.contextmanager
def atomic_file(final: Path, mode: str = "wb") -> Iterator[IO]:
    """Write `final` via a temporary sibling: fsync, rename, fsync the directory.

    On an exception the temporary file is removed and `final` is untouched.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_name(final)
    f = open(tmp, mode)
    try:
        yield f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise


def read_manifest(directory: Path) -> Manifest | None:
    path = directory / MANIFEST_NAME
    if not path.exists():
        return None
    return Manifest.from_json(path.read_bytes())


def write_manifest(directory: Path, manifest: Manifest) -> str:
    """Publish the manifest (last, atomically). Returns its digest, sha256:<hex>."""
    data = manifest.to_json()
    with atomic_file(directory / MANIFEST_NAME) as f:
        f.write(data)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_digest(directory: Path) -> str:
    return "sha256:" + hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()


def verify(directory: Path, workers: int = 4) -> Manifest:
    """Re-check every file in the manifest; raise IntegrityError naming the first bad one."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise IntegrityError(f"{directory}: no {MANIFEST_NAME} (incomplete or not prepared by ferry)")
    entries = sorted(manifest.files, key=lambda e: e.path)
    # Cheap checks first, so a missing or truncated file is reported without hashing everything.
    for entry in entries:
        path = directory / entry.path
        if not path.is_file():
            raise IntegrityError(f"{entry.path}: missing")
        if path.stat().st_size != entry.size:
            raise IntegrityError(f"{entry.path}: size {path.stat().st_size} != {entry.size} in manifest")
    # One task per block where blocks are recorded (one large file then hashes on every worker), else per file.
    tasks = [(e, i) for e in entries for i in (range(len(e.blocks)) if e.blocks else [None])]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for _ in pool.map(lambda task: check_part(directory / task[0].path, *task), tasks):
                pass
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return manifest


def check_part(path: Path, entry: FileEntry, block: int | None) -> None:
    """Block `block` of a file against its digest, or (None) the whole file against its sha256."""
    if block is None:
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise IntegrityError(f"{entry.path}: sha256 {digest} != {entry.sha256} in manifest")
        return
    h = hashlib.sha256()
    start, end = block * BLOCK_SIZE, min(entry.size, (block + 1) * BLOCK_SIZE)
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(min(HASH_CHUNK, BLOCK_SIZE)))
        offset = start
        while offset < end:
            n = os.preadv(f.fileno(), [buf[:min(len(buf), end - offset)]], offset)
            if n == 0:
                raise IntegrityError(f"{entry.path}: ended at byte {offset}, the manifest says {entry.size}")
            h.update(buf[:n])
            offset += n
    if h.hexdigest() != entry.blocks[block]:
        raise block_mismatch(entry, block, h.hexdigest())
