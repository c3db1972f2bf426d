"""The integrity manifest: what "complete" means for a prepared directory.

Every output file is written under a temporary name, fsynced and renamed into
place (`atomic_file`); `ferry-manifest.json` (file, size, sha256 for each) is
written last, the same way. A directory without a manifest is incomplete, and
`verify` re-checks every file listed in one.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
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


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    sha256: str
    # sha256 of each BLOCK_SIZE block, the last one shorter; empty when not recorded.
    blocks: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        body = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.blocks:
            body["blocks"] = list(self.blocks)
        return body


class BlockHasher:
    """sha256 of a whole file and of each of its BLOCK_SIZE blocks, in one pass over bytes fed in order."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self._whole = hashlib.sha256()
        self._block = hashlib.sha256()
        self._filled = 0
        self._blocks: list[str] = []

    def update(self, data: memoryview | bytes) -> None:
        data = memoryview(data)
        self._whole.update(data)
        while len(data):
            take = min(len(data), self.block_size - self._filled)
            self._block.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.block_size:
                self._blocks.append(self._block.hexdigest())
                self._block, self._filled = hashlib.sha256(), 0

    def result(self) -> tuple[str, tuple[str, ...]]:
        """(sha256 of everything, block digests)."""
        blocks = self._blocks + ([self._block.hexdigest()] if self._filled else [])
        return self._whole.hexdigest(), tuple(blocks)


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
            files=[FileEntry(f["path"], f["size"], f["sha256"],
                             tuple(f.get("blocks") or ()) if body.get("blockSize") == BLOCK_SIZE else ())
                   for f in body["files"]],
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
    return final.with_name(f".{final.name}{TMP_MARKER}-{os.getpid()}")


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
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for entry, digest in zip(entries, pool.map(lambda e: sha256_file(directory / e.path), entries)):
            if digest != entry.sha256:
                raise IntegrityError(f"{entry.path}: sha256 {digest} != {entry.sha256} in manifest")
    return manifest
