"""A node's weight cache: one verified copy of each artifact (or of the rank
files a pod serves), keyed by the artifact's manifest digest. The storage
layer of issue 17's node agent (docs/node-cache.md); the agent, the CSI mount
and the operator's side are not built yet.

Layout under the cache root (one filesystem, so renames are atomic):

    entries/<key>/        complete and verified; files 0444, directory 0555
    filling/<key>/        a fill under way: each file appears under its name only
                          once verified (load.reader copies through atomic_file),
                          so a fill killed at any point resumes from what is there
    holders/<key>/<id>    one empty file per pod that has the entry mounted
    meta/<key>.json       {"bytes", "lastUsed", "pinned"}
    locks/<key>.lock      flock held by the one fill of <key> (others wait for it)

`<key>` is the manifest's sha256 hex, plus `.ranks-0-1` for a rank subset of a
`sharded_state` artifact. An entry is only ever published by renaming a
complete `filling/<key>` to `entries/<key>`: a half-filled entry cannot be
mounted. Eviction is least recently used, only down to the low watermark,
and never touches an entry that is held (mounted) or pinned; a fill that
cannot fit under the high watermark fails with the reason instead of
filling the disk (the agent caps the high mark below the kubelet's
evictionHard, so the node never reaches DiskPressure because of the cache).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..load.reader import ReadOptions, read_files
from ..load.selection import select
from ..manifest import MANIFEST_NAME, IntegrityError, Manifest, atomic_file, fsync_dir

OnBytes = Callable[[int], None]


class CacheError(Exception):
    """The cache cannot serve this request; the message says why and what to do."""


class CacheFull(CacheError):
    """A fill would take the cache past its high watermark and nothing can be evicted."""


@dataclass(frozen=True)
class Watermarks:
    high: int  # bytes: a fill that would pass it evicts first, or is refused
    low: int  # eviction frees down to this

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(f"watermarks must satisfy 0 <= low <= high, got low {self.low}, high {self.high}")


def cache_key(digest: str, ranks: list[int] | None = None) -> str:
    hexdigest = digest.removeprefix("sha256:")
    if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
        raise CacheError(f"{digest!r} is not a manifest digest (sha256:<64 hex digits>)")
    return hexdigest + (f".ranks-{'-'.join(map(str, sorted(set(ranks))))}" if ranks is not None else "")


class CacheStore:
    def __init__(self, root: Path, marks: Watermarks, clock: Callable[[], float] = time.time):
        self.root, self.marks, self.clock = Path(root), marks, clock
        for part in ("entries", "filling", "holders", "meta", "locks"):
            (self.root / part).mkdir(parents=True, exist_ok=True)

    # -- reading ---------------------------------------------------------------------------------------------
    def entry(self, key: str) -> Path | None:
        path = self.root / "entries" / key
        return path if path.is_dir() else None

    def listing(self) -> dict:
        """Every entry with its bytes, last use, pin and holders, and the totals against the watermarks."""
        entries = {k: {**self._meta(k), "holders": self.holders(k)} for k in self._keys()}
        return {"entries": entries, "usage": self.usage(), "high": self.marks.high, "low": self.marks.low}

    def usage(self) -> int:
        """Bytes of the complete entries and of the fills under way."""
        done = sum(self._meta(k).get("bytes", 0) for k in self._keys())
        return done + sum(_tree_bytes(p) for p in (self.root / "filling").iterdir())

    # -- filling ---------------------------------------------------------------------------------------------
    def fill(self, source: Path, digest: str, ranks: list[int] | None = None, on_bytes: OnBytes = lambda n: None,
             after_file: Callable[[str], None] = lambda name: None) -> Path:
        """The entry of the artifact at `source` (a directory: a claim's) whose manifest has `digest`,
        filled and verified if it is not here yet. Concurrent fills of one key share one: the second
        waits for the first, then finds the entry. `after_file` runs after each file is verified in
        place (the fault tests stop a fill there)."""
        key = cache_key(digest, ranks)
        with self._lock(key):
            ready = self.entry(key)
            if ready is not None:
                self.touch(key)
                return ready
            manifest = _source_manifest(source, digest)
            wanted = select(manifest, ranks).entries
            staging = self.root / "filling" / key
            staging.mkdir(exist_ok=True)
            have = self._resumable(staging, wanted)
            missing = [e for e in wanted if e.path not in have]
            self._make_room(sum(e.size for e in missing), key)
            # Each file lands under its name only once verified (atomic_file), so a kill leaves whole
            # files behind; one file per call (its segments still read in parallel) so that
            # `after_file` can hold the fill between two of them.
            for e in missing:
                read_files(source, [e], ReadOptions(), on_bytes, copy_to=staging)
                after_file(e.path)
            shutil.copyfile(source / MANIFEST_NAME, staging / MANIFEST_NAME)
            return self._publish(key, staging, sum(e.size for e in wanted))

    def _resumable(self, staging: Path, wanted) -> set[str]:
        """Files a killed fill left, checked again (local reads): kept if whole and verified, else removed."""
        kept = set()
        for e in wanted:
            path = staging / e.path
            if not path.exists():
                continue
            try:
                read_files(staging, [e], ReadOptions())
                kept.add(e.path)
            except IntegrityError:
                path.unlink()
        for stray in staging.rglob("*"):
            if stray.is_file() and stray.relative_to(staging).as_posix() not in kept:
                stray.unlink()  # a temporary file of an interrupted copy
        return kept

    def _publish(self, key: str, staging: Path, nbytes: int) -> Path:
        for path in staging.rglob("*"):
            path.chmod(0o555 if path.is_dir() else 0o444)
        final = self.root / "entries" / key
        _write_json(self.root / "meta" / f"{key}.json", {"bytes": nbytes, "lastUsed": self.clock(), "pinned": False})
        staging.chmod(0o555)
        os.rename(staging, final)
        fsync_dir(final.parent)
        return final

    # -- holding, pinning, checking ------------------------------------------------------------------------------
    def acquire(self, key: str, holder: str) -> Path:
        """Mark the entry as mounted by `holder` (a pod uid): it is not evicted until released."""
        path = self.entry(key)
        if path is None:
            raise CacheError(f"no complete cache entry {key}: fill it first")
        held = self.root / "holders" / key
        held.mkdir(exist_ok=True)
        (held / _safe(holder)).touch()
        self.touch(key)
        return path

    def release(self, key: str, holder: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / "holders" / key / _safe(holder)).unlink()

    def holders(self, key: str) -> list[str]:
        held = self.root / "holders" / key
        return sorted(p.name for p in held.iterdir()) if held.is_dir() else []

    def pin(self, key: str, pinned: bool = True) -> None:
        meta = self._meta(key)
        if not meta:
            raise CacheError(f"no complete cache entry {key} to pin")
        _write_json(self.root / "meta" / f"{key}.json", {**meta, "pinned": pinned})

    def touch(self, key: str) -> None:
        meta = self._meta(key)
        if meta:
            _write_json(self.root / "meta" / f"{key}.json", {**meta, "lastUsed": self.clock()})

    def check(self, key: str) -> None:
        """Every byte of the entry against its manifest, before a mount: a corrupt entry is removed (the
        next fill fetches it again) and the error names the file."""
        path = self.entry(key)
        if path is None:
            raise CacheError(f"no complete cache entry {key}")
        manifest = Manifest.from_json((path / MANIFEST_NAME).read_bytes())
        ranks = _ranks_of(key)
        try:
            read_files(path, select(manifest, ranks).entries, ReadOptions())
        except IntegrityError:
            if not self.holders(key):
                self._remove(key)
            raise

    # -- eviction --------------------------------------------------------------------------------------------
    def evict(self, needed: int = 0, keep: str | None = None) -> list[str]:
        """Remove least recently used entries (not held, not pinned, not `keep`) until `needed` more bytes
        fit under the low watermark; returns the keys removed."""
        removed = []
        candidates = sorted((k for k in self._keys() if k != keep and not self.holders(k)
                             and not self._meta(k).get("pinned")), key=lambda k: self._meta(k).get("lastUsed", 0))
        used = self.usage()
        for key in candidates:
            if used + needed <= self.marks.low:
                break
            used -= self._meta(key).get("bytes", 0)
            self._remove(key)
            removed.append(key)
        return removed

    def _make_room(self, needed: int, key: str) -> None:
        if self.usage() + needed <= self.marks.high:
            return
        self.evict(needed, keep=key)
        used = self.usage()
        if used + needed > self.marks.high:
            blocking = [k for k in self._keys() if self.holders(k) or self._meta(k).get("pinned")]
            raise CacheFull(f"filling {key} needs {needed} more bytes; the cache holds {used} of its "
                            f"{self.marks.high}-byte high watermark and cannot evict {len(blocking)} entries "
                            f"that are mounted or pinned ({', '.join(blocking[:5])}): raise the watermark, "
                            f"unpin an entry, or let its pods go")

    def _remove(self, key: str) -> None:
        path = self.root / "entries" / key
        if path.exists():
            doomed = self.root / "filling" / f".evicted-{key}-{os.getpid()}"
            os.rename(path, doomed)  # gone from entries/ at once; the bytes go after
            for p in [doomed, *doomed.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
            shutil.rmtree(doomed)
        with contextlib.suppress(FileNotFoundError):
            (self.root / "meta" / f"{key}.json").unlink()

    # -- internals -------------------------------------------------------------------------------------------
    def _keys(self) -> list[str]:
        return sorted(p.name for p in (self.root / "entries").iterdir())

    def _meta(self, key: str) -> dict:
        try:
            return json.loads((self.root / "meta" / f"{key}.json").read_text())
        except FileNotFoundError:
            return {}

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        with open(self.root / "locks" / f"{key}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def _source_manifest(source: Path, digest: str) -> Manifest:
    """The source's manifest, trusted only if its sha256 is the digest the entry is keyed by."""
    path = source / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CacheError(f"{source} holds no {MANIFEST_NAME}: not a complete Ferry artifact") from None
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if actual != "sha256:" + digest.removeprefix("sha256:"):
        raise CacheError(f"{path} has digest {actual}, not {digest}: the artifact changed under its record")
    return Manifest.from_json(data)


def _ranks_of(key: str) -> list[int] | None:
    _, _, ranks = key.partition(".ranks-")
    return [int(r) for r in ranks.split("-")] if ranks else None


def _safe(holder: str) -> str:
    if not holder or "/" in holder or holder.startswith("."):
        raise CacheError(f"holder {holder!r} must be a plain name (a pod uid)")
    return holder


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _write_json(path: Path, value: dict) -> None:
    with atomic_file(path) as f:
        f.write(json.dumps(value).encode())
