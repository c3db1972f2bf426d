"""The integrity manifest: what "complete" means for a prepared directory.

Every output file is written under a temporary name, fsynced and renamed into
place (`atomic_file`); `ferry-manifest.json` (file, size and digest for each)
is written last, the same way. A directory without a manifest is incomplete,
and `verify` re-checks every file listed in one.

A file's digest is one of two forms, and a reader accepts either (or both,
as the release before this one wrote for rank files):
- `sha256`: of the whole file (fetched and copied files);
- `blocks`: the digest of each `blockSize` block, the last one shorter
  (`ferry shard`'s rank files). Each byte is hashed once, and a reader can
  check one large file on every core at once. Integrity is the same: the
  manifest's own digest, which the serving Deployment is wired for, covers
  the block list. The entry's `blockHash` names the block digest: `blake3`
  (what `ferry shard` writes: about 5x SHA-256's speed per core on this
  machine's SHA-NI cores, so neither the cut nor a serving pod's check is
  bound by hashing) or `sha256` (an entry without `blockHash`, as releases
  before it wrote). A manifest with a blake3 entry is `manifestVersion` 2,
  which a release that knows only sha256 blocks refuses by its version
  instead of calling every block corrupt.

A manifest is hostile input wherever it is read: a tenant can write one on
her own claim, in a cache slot, or under her S3 prefix. Each entry's path is
a plain relative path (paths.path_problem: no `..`, no absolute path, no
empty or `.` segment, no backslash or control character, bounded length and
depth), never a name Ferry reserves (the manifest's own, its temporary and
private names), listed once, with a byte count for a size; the whole is
bounded in bytes read, entries and total size. Files are opened beneath the
artifact's root without following a symlink at any component (`opened`), so
a link a tenant planted leads nowhere. A refusal names the entry and why.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Iterator

import blake3

from . import __version__
from .paths import UnsafePathError, open_beneath, open_dir_beneath, path_problem, read_beneath

MANIFEST_NAME = "ferry-manifest.json"
MANIFEST_VERSION = 1  # what a manifest of whole-file and sha256-block digests is written as
BLAKE3_MANIFEST_VERSION = 2  # one with blake3 block digests (blockHash), which version 1's readers cannot check
TMP_MARKER = ".ferry-tmp"
FERRY_PRIVATE_PREFIX = ".ferry-"  # Ferry's own files beside an artifact's (journal, pending records)
MAX_MANIFEST_BYTES = 64 << 20  # the manifest file itself
MAX_ENTRIES = 100_000
MAX_TOTAL_BYTES = 1 << 50  # 1 PiB
NOT_FERRYS = "the artifact was not written by ferry or was altered: prepare it again"
HASH_CHUNK = 8 << 20
# Block digests (sharded_state rank files): `ferry load` verifies one large
# file on several cores at once, block by block, instead of one sequential sha256.
BLOCK_SIZE = 64 << 20
# The block digests a reader checks, by an entry's blockHash (absent: sha256); both give 64 hex digits.
BLOCK_HASHES = {"sha256": hashlib.sha256, "blake3": blake3.blake3}
SHARD_BLOCK_HASH = "blake3"  # what `ferry shard` writes


class IntegrityError(Exception):
    """A file is missing, has the wrong size or the wrong content."""


_DIGEST = re.compile(r"[0-9a-f]{64}")  # a sha256, or a blake3 of its default 32 bytes


def reserved_name(path: str) -> bool:
    """A name Ferry keeps for its own files (the manifest, temporary and private names): never an entry."""
    return path == MANIFEST_NAME or any(
        part.startswith(FERRY_PRIVATE_PREFIX) or TMP_MARKER in part for part in path.split("/"))


def refused(path: object, why: str) -> IntegrityError:
    """The refusal of a manifest entry: which (its path, shortened), why, and what to do."""
    shown = repr(path)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return IntegrityError(f"{MANIFEST_NAME} entry {shown}: {why}; {NOT_FERRYS}")


def entry_problem(path: object, size: object) -> str | None:
    """Why (path, size) cannot be a manifest entry, or None."""
    problem = path_problem(path)
    if problem:
        return problem
    if reserved_name(path):
        return "a name Ferry reserves for its own files"
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_TOTAL_BYTES:
        return f"size {size!r} is not a byte count (an integer from 0 to {MAX_TOTAL_BYTES})"
    return None


def block_hash_problem(name: object) -> str | None:
    """Why `name` cannot be an entry's blockHash, or None."""
    if isinstance(name, str) and name in BLOCK_HASHES:
        return None
    shown = repr(name)
    shown = shown if len(shown) <= 40 else shown[:40] + "..."
    return f"blockHash {shown} is none this release checks ({', '.join(BLOCK_HASHES)})"


def block_count(size: int) -> int:
    """Blocks of a file of `size` bytes: an empty file has one, the digest of nothing."""
    return max(1, -(-size // BLOCK_SIZE))


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, POSIX separators
    size: int
    sha256: str | None = None  # of the whole file, when recorded
    # The digest of each BLOCK_SIZE block, the last one shorter; empty when not recorded.
    blocks: tuple[str, ...] = ()
    block_hash: str = "sha256"  # which digest `blocks` are (a key of BLOCK_HASHES)

    def __post_init__(self) -> None:
        problem = entry_problem(self.path, self.size)
        if problem:
            raise refused(self.path, problem)
        if not self.sha256 and not self.blocks:
            raise IntegrityError(f"{self.path}: the manifest records neither a sha256 nor block digests for it")
        problem = block_hash_problem(self.block_hash)
        if problem:
            raise refused(self.path, problem)
        for digest in ([self.sha256] if self.sha256 else []) + list(self.blocks):
            if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
                raise IntegrityError(f"{self.path}: {digest!r} in the manifest is not a digest (64 hex digits)")
        if self.blocks and len(self.blocks) != block_count(self.size):
            raise IntegrityError(f"{self.path}: {len(self.blocks)} block digests in the manifest for {self.size} "
                                 f"bytes in blocks of {BLOCK_SIZE}; {block_count(self.size)} expected")

    def to_dict(self) -> dict:
        body: dict = {"path": self.path, "size": self.size}
        if self.sha256:
            body["sha256"] = self.sha256
        if self.blocks:
            body["blocks"] = list(self.blocks)
            if self.block_hash != "sha256":
                body["blockHash"] = self.block_hash
        return body

    def block_hasher(self):
        """A fresh hash object of this entry's block digest."""
        return BLOCK_HASHES[self.block_hash]()

    @classmethod
    def from_dict(cls, body: dict, block_size: object) -> "FileEntry":
        if not isinstance(body, dict):
            raise refused(body, "not an object with a path and a size")
        path, size, sha256, blocks = body.get("path"), body.get("size"), body.get("sha256"), body.get("blocks") or ()
        block_hash = body.get("blockHash", "sha256")
        problem = (entry_problem(path, size) or (None if isinstance(blocks, list | tuple) else "blocks is not a list")
                   or block_hash_problem(block_hash))
        if problem:
            raise refused(path, problem)
        blocks = tuple(blocks)
        if blocks and block_size != BLOCK_SIZE:
            if not sha256:
                raise IntegrityError(f"{path}: only block digests in the manifest, of blockSize {block_size!r}; "
                                     f"this release checks blocks of {BLOCK_SIZE} bytes")
            blocks = ()  # another block size: the whole-file sha256 still checks it
        return cls(path, size, sha256, blocks, block_hash if blocks else "sha256")


class BlockHasher:
    """The digest (a BLOCK_HASHES name) of each block of the bytes fed in order: every byte hashed once."""

    def __init__(self, algorithm: str = "sha256", block_size: int | None = None) -> None:
        self._new = BLOCK_HASHES[algorithm]
        self.block_size = block_size or BLOCK_SIZE  # read at call time (tests shrink it)
        self._block = self._new()
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
                self._block, self._filled = self._new(), 0

    def result(self) -> tuple[str, ...]:
        """The block digests; one (of nothing) for no bytes at all."""
        if self._filled or not self._blocks:
            return (*self._blocks, self._block.hexdigest())
        return tuple(self._blocks)


def block_mismatch(entry: FileEntry, index: int, digest: str) -> IntegrityError:
    start = index * BLOCK_SIZE
    end = min(entry.size, start + BLOCK_SIZE)
    return IntegrityError(f"{entry.path}: block {index} (bytes {start}-{end - 1}) has {entry.block_hash} {digest}, "
                          f"the manifest says {entry.blocks[index]}")


class ContentCheck:
    """A file's bytes, fed in order, against its manifest entry: its block digests when recorded, else its
    sha256. `whole` also computes the whole file's sha256 when only blocks are recorded (a second hash:
    for a caller that must hand it on, e.g. to a store that checks its own read against it)."""

    def __init__(self, entry: FileEntry, whole: bool = False) -> None:
        self.entry = entry
        self._blocks = BlockHasher(entry.block_hash) if entry.blocks else None
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

    def __post_init__(self) -> None:
        """The whole is bounded, and each path is one file: listed once, never also a directory of another."""
        if len(self.files) > MAX_ENTRIES:
            raise IntegrityError(f"{MANIFEST_NAME}: {len(self.files)} entries, more than {MAX_ENTRIES}; {NOT_FERRYS}")
        paths: set[str] = set()
        for f in self.files:
            if f.path in paths:
                raise refused(f.path, "listed twice")
            paths.add(f.path)
        for f in self.files:
            parts = f.path.split("/")
            for depth in range(1, len(parts)):
                if "/".join(parts[:depth]) in paths:
                    raise refused(f.path, f"{'/'.join(parts[:depth])!r} is listed as a file too")
        if self.total_bytes > MAX_TOTAL_BYTES:
            raise IntegrityError(f"{MANIFEST_NAME}: {self.total_bytes} bytes in all, more than {MAX_TOTAL_BYTES}; "
                                 f"{NOT_FERRYS}")

    @property
    def version(self) -> int:
        """The lowest manifestVersion whose readers can check every entry."""
        blake3_blocks = any(f.blocks and f.block_hash != "sha256" for f in self.files)
        return BLAKE3_MANIFEST_VERSION if blake3_blocks else MANIFEST_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = {
            "manifestVersion": self.version,
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
        """Parse a manifest as hostile input: IntegrityError, naming the entry and why, for anything Ferry
        would not have written."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise IntegrityError(f"{MANIFEST_NAME}: {len(data)} bytes, more than {MAX_MANIFEST_BYTES}; {NOT_FERRYS}")
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise IntegrityError(f"{MANIFEST_NAME}: not JSON ({str(e)[:200]}); {NOT_FERRYS}") from None
        if not isinstance(body, dict):
            raise IntegrityError(f"{MANIFEST_NAME}: not a JSON object; {NOT_FERRYS}")
        version = body.get("manifestVersion")
        if type(version) is not int or version not in (MANIFEST_VERSION, BLAKE3_MANIFEST_VERSION):
            raise IntegrityError(f"unsupported manifest version {version!r}: this release reads versions "
                                 f"{MANIFEST_VERSION} and {BLAKE3_MANIFEST_VERSION}; run the worker image that "
                                 "prepared it, or prepare it again")
        files, extra = body.get("files"), body.get("extra", {})
        if not isinstance(files, list) or not isinstance(extra, dict):
            raise IntegrityError(f"{MANIFEST_NAME}: its files are not a list or its extra not an object; {NOT_FERRYS}")
        if len(files) > MAX_ENTRIES:
            raise IntegrityError(f"{MANIFEST_NAME}: {len(files)} entries, more than {MAX_ENTRIES}; {NOT_FERRYS}")
        manifest = cls(
            files=[FileEntry.from_dict(f, body.get("blockSize")) for f in files],
            source=body.get("source", ""),
            revision=body.get("revision"),
            format=body.get("format", "safetensors"),
            tool=body.get("tool", ""),
            created_at=body.get("createdAt", ""),
            extra=extra,
        )
        if version < manifest.version:
            raise IntegrityError(f"{MANIFEST_NAME}: manifestVersion {version} with blake3 block digests, which "
                                 f"only version {manifest.version} records; {NOT_FERRYS}")
        return manifest


def sha256_file(path: Path | int) -> str:
    """sha256 of a file, by path or of an open fd (read from its start; the fd stays open)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0, closefd=not isinstance(path, int)) as f:
        buf = bytearray(HASH_CHUNK)
        view = memoryview(buf)
        offset = 0
        while n := os.preadv(f.fileno(), [buf], offset):
            h.update(view[:n])  # hashlib releases the GIL on large buffers
            offset += n
    return h.hexdigest()


@contextlib.contextmanager
def opened(directory: Path, path: str) -> Iterator[int]:
    """A read fd of the regular file an entry's `path` names under `directory`, reached without following a
    symlink at any component (paths.open_beneath): IntegrityError naming the entry when it is missing,
    behind a symlink or not a regular file. Nothing outside `directory` is opened or stat'ed."""
    try:
        fd = open_beneath(directory, path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)  # a fifo must not block
    except (FileNotFoundError, NotADirectoryError):
        raise IntegrityError(f"{path}: missing") from None
    except UnsafePathError as e:
        raise refused(path, str(e)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refused(path, "not a regular file")
        yield fd
    finally:
        os.close(fd)


def check_sizes(directory: Path, entries) -> None:
    """Each entry present under `directory` (opened) with its manifest size: cheap, before any byte is read,
    so a missing or truncated file is named at once."""
    for entry in entries:
        with opened(directory, entry.path) as fd:
            size = os.fstat(fd).st_size
        if size != entry.size:
            raise IntegrityError(f"{entry.path}: size {size} != {entry.size} in manifest")


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
def atomic_file(final: Path, mode: str = "wb", *, beneath: Path | None = None) -> Iterator[IO]:
    """Write `final` via a temporary sibling: fsync, rename, fsync the directory.

    On an exception the temporary file is removed and `final` is untouched. The temporary file is never
    opened through a symlink. With `beneath` (a directory above `final` that others write too: a cache slot,
    a copy's root), each directory between the two is made or opened without following a symlink.
    """
    if beneath is None:
        final.parent.mkdir(parents=True, exist_ok=True)
        parent = os.open(final.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        beneath.mkdir(parents=True, exist_ok=True)  # the caller's own: followed as given
        relative = final.parent.relative_to(beneath).as_posix()
        parent = open_dir_beneath(beneath, "" if relative == "." else relative, make_dirs=True)
    tmp = tmp_name(final).name
    try:
        flags = (os.O_RDWR if "+" in mode else os.O_WRONLY) | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        f = os.fdopen(os.open(tmp, flags, 0o666, dir_fd=parent), mode)
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(tmp, final.name, src_dir_fd=parent, dst_dir_fd=parent)
            os.fsync(parent)
        except BaseException:
            f.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=parent)
            raise
    finally:
        os.close(parent)


def read_manifest_bytes(directory: Path, name: str = MANIFEST_NAME) -> bytes | None:
    """The manifest file's bytes (None when absent), never read through a symlink nor past
    MAX_MANIFEST_BYTES: IntegrityError naming it."""
    try:
        return read_beneath(directory, name, MAX_MANIFEST_BYTES)
    except UnsafePathError as e:
        raise IntegrityError(f"{directory}: {e}; {NOT_FERRYS}") from None


def read_manifest(directory: Path) -> Manifest | None:
    data = read_manifest_bytes(directory)
    return None if data is None else Manifest.from_json(data)


def write_manifest(directory: Path, manifest: Manifest) -> str:
    """Publish the manifest (last, atomically). Returns its digest, sha256:<hex>."""
    data = manifest.to_json()
    with atomic_file(directory / MANIFEST_NAME) as f:
        f.write(data)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def manifest_digest(directory: Path) -> str:
    data = read_manifest_bytes(directory)
    if data is None:
        raise IntegrityError(f"{directory}: no {MANIFEST_NAME} (incomplete or not prepared by ferry)")
    return "sha256:" + hashlib.sha256(data).hexdigest()


def verify(directory: Path, workers: int = 4) -> Manifest:
    """Re-check every file in the manifest; raise IntegrityError naming the first bad one."""
    manifest = read_manifest(directory)
    if manifest is None:
        raise IntegrityError(f"{directory}: no {MANIFEST_NAME} (incomplete or not prepared by ferry)")
    entries = sorted(manifest.files, key=lambda e: e.path)
    check_sizes(directory, entries)  # cheap checks first: a missing or truncated file named without hashing
    # One task per block where blocks are recorded (one large file then hashes on every worker), else per file.
    tasks = [(e, i) for e in entries for i in (range(len(e.blocks)) if e.blocks else [None])]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for _ in pool.map(lambda task: check_part(directory, *task), tasks):
                pass
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return manifest


def check_part(directory: Path, entry: FileEntry, block: int | None) -> None:
    """Block `block` of an entry's file under `directory` against its digest, or (None) the whole file
    against its sha256."""
    with opened(directory, entry.path) as fd:
        if block is None:
            digest = sha256_file(fd)
            if digest != entry.sha256:
                raise IntegrityError(f"{entry.path}: sha256 {digest} != {entry.sha256} in manifest")
            return
        _check_block(fd, entry, block)


def _check_block(fd: int, entry: FileEntry, block: int) -> None:
    h = entry.block_hasher()
    start, end = block * BLOCK_SIZE, min(entry.size, (block + 1) * BLOCK_SIZE)
    buf = memoryview(bytearray(min(HASH_CHUNK, BLOCK_SIZE)))
    offset = start
    while offset < end:
        n = os.preadv(fd, [buf[:min(len(buf), end - offset)]], offset)
        if n == 0:
            raise IntegrityError(f"{entry.path}: ended at byte {offset}, the manifest says {entry.size}")
        h.update(buf[:n])
        offset += n
    if h.hexdigest() != entry.blocks[block]:
        raise block_mismatch(entry, block, h.hexdigest())
