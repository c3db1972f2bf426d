"""A node's weight cache: one verified copy of each artifact (or of the rank
files a pod serves), keyed by the artifact's manifest digest. The storage
layer of issue 17's node agent (docs/node-cache.md): the agent's CSI driver
(`csi/`) hands fill pods a slot and serving pods a read-only entry.

Layout under the cache root (one filesystem, so renames are atomic):

    entries/<key>/        complete and verified; files 0444, directory 0555
    filling/<key>/        a fill under way, by the agent itself (`fill`) or by a
                          fill pod in a slot (`slot`, then `adopt`): the manifest
                          is written first under PENDING_MANIFEST, each file
                          appears under its name only once verified (load.reader
                          copies through atomic_file), the manifest's own name
                          last; a fill killed at any point resumes from what the
                          pending manifest verifies
    holders/<key>/<id>    one empty file per pod that has the entry mounted
    meta/<key>.json       {"bytes", "lastUsed", "pinned", "namespace"}
    slots/<key>           a fill pod's reservation: {"bytes", "namespace", "at"}
    locks/<key>.lock      flock held by the one fill of <key> (others wait for it)

`<key>` is the manifest's sha256 hex, plus `.ranks-0-1` for a rank subset of a
`sharded_state` artifact. An entry is only ever published by renaming a
complete `filling/<key>` to `entries/<key>`: a half-filled entry cannot be
mounted. Eviction is least recently used, only down to the low watermark,
and never touches an entry that is held (mounted) or pinned; a fill that
cannot fit under the high watermark, or would leave the disk less free than
`keep_free` (the kubelet's evictionHard plus a margin: other writers on the
disk count too), fails with the reason instead of pushing the node into
DiskPressure.

Fair between namespaces (`Fairness`): an entry counts against the namespace
whose fill pod brought it, a slot against its pod's namespace. A fill that
would take its namespace past its share evicts only that namespace's idle
entries to fit, or is refused with the numbers: it never evicts another
namespace's entry. A slot's reservation holds room for at most
`reservation_s` (the operator's fill Job deadline is capped the same);
after that only the bytes the pod wrote count.

A slot is written by a tenant's fill pod, so what the agent (root) finds
there is hostile: its manifest is parsed as hostile input (manifest.py), and
every file is opened, checked and removed beneath the slot without following
a symlink (paths.open_beneath, unlink_beneath), so a manifest naming `..`, an
absolute path or a path through a planted link reaches nothing outside it. The
slot's tree itself is walked, taken over, chmod'ed, counted and removed through
directory fds, never recursively and within bounds (slot_tree.py): a planted
link, fifo, device node or tree thousands of levels deep leads the agent
nowhere, and a live slot counts the blocks its files occupy (a sparse file
cannot fill the cache's books). A slot a fill pod has reserved is not taken
over by `fill` (`ferry cache fill`) while the reservation lasts.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from ..load.reader import ReadOptions, read_files
from ..load.selection import select
from ..manifest import (
    MANIFEST_NAME,
    IntegrityError,
    Manifest,
    atomic_file,
    check_sizes,
    fsync_dir,
    opened,
    read_manifest,
    read_manifest_bytes,
)
from ..paths import unlink_beneath
from .slot_tree import TreeRefused, open_to, remove_tree, take_over, used_bytes, walk

OnBytes = Callable[[int], None]
log = logging.getLogger(__name__)
PENDING_MANIFEST = ".ferry-manifest.pending.json"  # a fill's manifest until every file is in
SETTLE_NS = 2_000_000_000  # file times are as coarse as a clock tick (or a second): see CacheStore.check


class CacheError(Exception):
    """The cache cannot serve this request; the message says why and what to do."""


class CorruptEntry(CacheError):
    """The entry was found corrupt while pods had it mounted: nothing new gets it until it is gone."""


class CacheFull(CacheError):
    """A fill would take the cache past its high watermark and nothing can be evicted."""


@dataclass(frozen=True)
class Watermarks:
    high: int  # bytes: a fill that would pass it evicts first, or is refused
    low: int  # eviction frees down to this
    keep_free: int = 0  # bytes of the filesystem that stay free whatever the marks (the kubelet's evictionHard)

    def __post_init__(self) -> None:
        if self.keep_free < 0 or not 0 <= self.low <= self.high:
            raise ValueError(f"watermarks must satisfy 0 <= low <= high, got low {self.low}, high {self.high}")


DEFAULT_RESERVATION_S = 4 * 3600


@dataclass(frozen=True)
class Fairness:
    namespace_share: int = 0  # bytes one namespace's entries and slots may hold on the node; 0: no limit
    reservation_s: float = DEFAULT_RESERVATION_S  # how long a slot's declared bytes hold room


def cache_key(digest: str, ranks: list[int] | None = None) -> str:
    hexdigest = digest.removeprefix("sha256:")
    if len(hexdigest) != 64 or any(c not in "0123456789abcdef" for c in hexdigest):
        raise CacheError(f"{digest!r} is not a manifest digest (sha256:<64 hex digits>)")
    return hexdigest + (f".ranks-{'-'.join(map(str, sorted(set(ranks))))}" if ranks is not None else "")


# Why an entry was removed (said in the node's labels, and by the operator in an Event).
LEAST_RECENTLY_USED, CORRUPT, REMOVED_BY_ADMIN = "lru", "corrupt", "removed"
REMOVAL_MEMORY_S = 600.0  # how long a removal is remembered (and shown on the node)


class CacheStore:
    def __init__(self, root: Path, marks: Watermarks, clock: Callable[[], float] = time.time,
                 disk_free: Callable[[], int] | None = None, reverify_after: float = 0.0,
                 fairness: Fairness = Fairness()):
        self.root, self.marks, self.clock, self.fairness = Path(root), marks, clock, fairness
        # A serving mount skips the full verification of an entry verified less than this many seconds ago
        # whose files are unchanged since (same inodes, sizes, mtimes, ctimes: a write shows); 0: every mount.
        self.reverify_after = reverify_after
        self.disk_free = disk_free or (lambda: shutil.disk_usage(self.root).free)
        self.on_change: Callable[[], None] = lambda: None  # an entry was published or removed (node labels)
        for part in ("entries", "filling", "holders", "meta", "locks", "slots", "removed"):
            (self.root / part).mkdir(parents=True, exist_ok=True)
        for doomed in (self.root / "filling").glob(".evicted-*"):  # an eviction a crash interrupted
            try:
                remove_tree(doomed)
            except OSError as e:
                log.warning("could not remove %s, an interrupted eviction (%s): remove it by hand", doomed, e)

    # -- reading ---------------------------------------------------------------------------------------------
    def entry(self, key: str) -> Path | None:
        path = self.root / "entries" / key
        return path if path.is_dir() else None

    def keys(self) -> list[str]:
        """The complete entries."""
        return sorted(p.name for p in (self.root / "entries").iterdir())

    def listing(self) -> dict:
        """Every entry with its bytes, last use, pin and holders, and the totals against the watermarks."""
        entries = {k: {**self._meta(k), "holders": self.holders(k)} for k in self.keys()}
        return {"entries": entries, "usage": self.usage(), "high": self.marks.high, "low": self.marks.low}

    def usage(self) -> int:
        """Bytes of the complete entries and of the fills under way (a fill pod's slot counts the bytes it
        declared until it has written more: room made for one fill is not given to the next)."""
        done = sum(self._meta(k).get("bytes", 0) for k in self.keys())
        return done + sum(max(used_bytes(p).blocks, self._declared(p.name)) for p in (self.root / "filling").iterdir())

    def _declared(self, key: str) -> int:
        """The bytes a slot reserves: what its fill pod declared, until `reservation_s` has passed."""
        reservation = self._reservation(key)
        if self.clock() - reservation.get("at", 0) > self.fairness.reservation_s:
            return 0
        return reservation.get("bytes", 0)

    def _reserved(self, key: str) -> bool:
        """Whether a fill pod holds `key`'s slot: its reservation is there and `reservation_s` has not passed."""
        reservation = self._reservation(key)
        return bool(reservation) and self.clock() - reservation.get("at", 0) <= self.fairness.reservation_s

    def _reservation(self, key: str) -> dict:
        path = self.root / "slots" / key
        try:
            text, at = path.read_text(), path.stat().st_mtime
        except FileNotFoundError:
            return {}
        try:
            record = json.loads(text)
        except ValueError:
            return {}
        if isinstance(record, int):  # an agent before fairness wrote the bytes alone
            return {"bytes": record, "namespace": "", "at": at}
        return record if isinstance(record, dict) else {}

    def namespace_usage(self, namespace: str, but: str = "") -> int:
        """Bytes `namespace` holds on this node: the entries its fill pods brought, and its slots (but `but`). A
        slot too deep or too wide to count whole (bytes may hide past the bounds) counts as the whole share."""
        done = sum(self._meta(k).get("bytes", 0) for k in self.keys() if self._meta(k).get("namespace") == namespace)
        return done + sum(self._slot_bytes(p) for p in (self.root / "filling").iterdir()
                          if p.name != but and self._reservation(p.name).get("namespace") == namespace)

    def _slot_bytes(self, slot: Path) -> int:
        used = used_bytes(slot)
        hidden = 0 if used.complete else self.fairness.namespace_share
        return max(used.blocks, self._declared(slot.name), hidden)

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
            manifest_bytes = source_manifest_bytes(source, digest)
            if self._reserved(key):
                raise CacheError(f"{key} has a live fill slot reservation (slots/{key}): a fill pod may still be "
                                 f"writing there; let it finish (the agent publishes what it filled), or fill "
                                 f"again once the reservation passes ({self.fairness.reservation_s:.0f} s after "
                                 f"the slot was made)")
            staging = self._taken_over(key)  # a slot a fill pod left: the agent's own before it reads anything there
            wanted = select(Manifest.from_json(manifest_bytes), ranks).entries  # refused unless Ferry's
            missing = [e for e in wanted if e.path not in keep_verified(staging, wanted, digest)]
            self._make_room(sum(e.size for e in missing), key)
            copy_into(staging, source, manifest_bytes, missing, on_bytes, after_file)
            return self._publish(key, staging, sum(e.size for e in wanted))

    # -- fill pods: a slot to fill, adopted once the pod is done --------------------------------------------
    def slot(self, key: str, nbytes: int, namespace: str = "") -> Path:
        """The staging directory a fill pod of `namespace` writes `key` into (made writable for the pod's
        uid), with room for `nbytes` made first, within the namespace's share: a fill that cannot fit is
        refused before a byte moves."""
        with self._lock(key):
            staging = self._taken_over(key)  # what an earlier fill left: root's, nothing but files and directories
            needed = max(0, nbytes - used_bytes(staging).blocks)
            self._fit_share(namespace, needed, key)
            self._make_room(needed, key)
            # Reserved until adopted or dropped, or reservation_s passed.
            _write_json(self.root / "slots" / key, {"bytes": nbytes, "namespace": namespace, "at": self.clock()})
            # The pod runs as its own (non-root) uid, so every directory is opened to the pod, each through its
            # own fd (its verified files stay root's and read-only, and are kept).
            _open_to(key, staging, 0o777)
            return staging

    def _taken_over(self, key: str) -> Path:
        """`key`'s staging directory, made if absent, else taken over (slot_tree.take_over); a tree past the
        walk's bounds is removed and an empty one made: nothing of it is kept."""
        staging = self.root / "filling" / key
        staging.mkdir(exist_ok=True)
        try:
            take_over(staging)
        except TreeRefused as e:
            log.warning("removed what a fill of %s left: %s", key, e)
            remove_tree(staging)
            staging.mkdir()
        return staging

    def adopt(self, key: str, nbytes: int) -> Path:
        """Publish what a fill pod left in its slot, trusting none of it: anything but a regular file is
        removed (a symlink cannot lead the agent to a host file), every file becomes root's and read-only,
        more bytes than declared are refused, and every byte is verified against the manifest whose sha256
        is the digest. An unfinished slot keeps only what that manifest verifies, for the next fill pod."""
        with self._lock(key):
            if self.entry(key) is not None:
                self._drop_slot(key)
                return self.entry(key)
            staging = self.root / "filling" / key
            if not staging.is_dir():
                raise CacheError(f"no fill slot for {key}")
            try:
                have = take_over(staging).size  # what the files claim: a sparse file is refused on its size
            except TreeRefused as e:
                self._drop_slot(key)
                raise CacheError(f"the fill of {key} left {e}: removed; a fill writes only the artifact's "
                                 f"files") from None
            digest = key.partition(".")[0]
            manifest_bytes = _slot_manifest_bytes(staging, digest)
            if manifest_bytes is None:
                self._drop_slot(key)
                raise CacheError(f"the fill of {key} left no manifest whose sha256 is {digest}: removed")
            try:
                wanted = select(Manifest.from_json(manifest_bytes), _ranks_of(key)).entries
            except IntegrityError as e:  # a manifest Ferry never writes: nothing in the slot is touched by it
                self._drop_slot(key)
                raise CacheError(f"the fill of {key} left a manifest Ferry refuses ({e}): removed") from None
            listed = sum(e.size for e in wanted)
            if listed > nbytes:  # the declared bytes are what room and the namespace's share were held for
                self._drop_slot(key)
                raise CacheError(f"the fill of {key} declared {nbytes} bytes and its manifest lists {listed}: "
                                 f"removed; the fill must declare the artifact's size")
            limit = nbytes + len(manifest_bytes) * 2
            if have > limit:
                self._drop_slot(key)
                raise CacheError(f"the fill of {key} left {have} bytes, more than the {limit} it declared: removed")
            verified = keep_verified(staging, wanted, digest)
            missing = [e.path for e in wanted if e.path not in verified]
            if missing:
                with contextlib.suppress(FileNotFoundError):  # not complete: the manifest waits under its
                    os.replace(staging / MANIFEST_NAME, staging / PENDING_MANIFEST)  # pending name again
                raise CacheError(f"the fill of {key} is unfinished: {len(missing)} files missing or corrupt "
                                 f"(first: {missing[0]}); the verified ones are kept for the next fill")
            install_manifest(staging, manifest_bytes)
            namespace = self._reservation(key).get("namespace", "")
            return self._publish(key, staging, sum(e.size for e in wanted), namespace)

    def _drop_slot(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            remove_tree(self.root / "filling" / key)
        (self.root / "slots" / key).unlink(missing_ok=True)

    def _publish(self, key: str, staging: Path, nbytes: int, namespace: str = "") -> Path:
        _open_to(key, staging, 0o555, 0o444, root_too=False)  # through fds: nothing followed (the root goes last)
        with contextlib.suppress(FileNotFoundError):
            (staging / PENDING_MANIFEST).unlink()
        final = self.root / "entries" / key
        self._write_meta(key, {"bytes": nbytes, "lastUsed": self.clock(), "pinned": False, "namespace": namespace})
        staging.chmod(0o555)
        os.rename(staging, final)
        fsync_dir(final.parent)
        (self.root / "slots" / key).unlink(missing_ok=True)
        self._stamp_verified(key, _fingerprint(final)[0], self.clock())  # every byte verified on its way in
        (self.root / "removed" / key).unlink(missing_ok=True)
        self.on_change()
        return final

    # -- holding, pinning, checking ------------------------------------------------------------------------------
    def acquire(self, key: str, holder: str) -> Path:
        """Mark the entry as mounted by `holder` (a pod uid): it is not evicted until released. Under the
        entry's lock, which eviction takes too: an entry is never removed between a check and a hold."""
        with self._lock(key):
            path = self.entry(key)
            if path is None:
                raise CacheError(f"no complete cache entry {key}: fill it first")
            if self._meta(key).get("corrupt") is not None:
                n = len(self.holders(key))
                raise CorruptEntry(f"cache entry {key} was found corrupt and is still mounted by {n} "
                                   f"pod{'' if n == 1 else 's'}: it is removed as they let go, then filled again")
            held = self.root / "holders" / key
            held.mkdir(exist_ok=True)
            (held / _safe(holder)).touch()
            self.touch(key)
            return path

    def mount_entry(self, key: str, holder: str) -> tuple[Path, bool]:
        """(the entry, held by `holder`; whether it was verified byte by byte now): what a serving mount
        gets. Verified unless it was within `reverify_after` with its files unchanged since, so a burst of
        pods on one node (a rollout, a scale-up) pays for one verification; the pod's loader verifies every
        byte it reads either way. A corrupt entry is released and, unless another pod still has it mounted,
        removed: the next fill fetches it again. Raises IntegrityError naming the file."""
        path = self.acquire(key, holder)
        if self._recently_verified(key):
            return path, False
        try:
            self.check(key)
        except IntegrityError:
            self.release(key, holder)  # the last holder gone: a corrupt entry is removed
            raise
        except BaseException:
            self.release(key, holder)
            raise
        return path, True

    def _recently_verified(self, key: str) -> bool:
        verified = self._meta(key).get("verified") or {}
        return (self.reverify_after > 0 and verified.get("at", float("-inf")) >= self.clock() - self.reverify_after
                and verified.get("files") == _fingerprint(self.root / "entries" / key)[0])

    def _stamp_verified(self, key: str, files: str | None, at: float) -> None:
        """Record that the entry, as `files` fingerprinted it, was verified at `at` (None: forget any stamp)."""
        meta = self._meta(key)
        if not meta:
            return
        if files is None:
            meta.pop("verified", None)
        else:
            meta["verified"] = {"at": at, "files": files}
        self._write_meta(key, meta)

    def release(self, key: str, holder: str) -> None:
        """`holder` no longer has the entry mounted. An entry found corrupt while pods had it mounted is
        removed as its last holder goes (the next fill fetches it again)."""
        with self._lock(key):
            with contextlib.suppress(FileNotFoundError):
                (self.root / "holders" / key / _safe(holder)).unlink()
            if self._meta(key).get("corrupt") is not None and self.entry(key) is not None and not self.holders(key):
                log.warning("removed corrupt entry %s as its last pod let go: the next fill fetches it again", key)
                self._remove(key, CORRUPT)

    def corrupt(self) -> dict[str, float]:
        """Entries found corrupt while pods have them mounted (removed once they let go): key -> when."""
        return {k: float(at) for k in self.keys() if (at := self._meta(k).get("corrupt")) is not None}

    def holders(self, key: str) -> list[str]:
        held = self.root / "holders" / key
        return sorted(p.name for p in held.iterdir()) if held.is_dir() else []

    def pin(self, key: str, pinned: bool = True) -> None:
        meta = self._meta(key)
        if not meta:
            raise CacheError(f"no complete cache entry {key} to pin")
        self._write_meta(key, {**meta, "pinned": pinned})

    def touch(self, key: str) -> None:
        meta = self._meta(key)
        if meta:
            self._write_meta(key, {**meta, "lastUsed": self.clock()})

    def check(self, key: str) -> None:
        """Every byte of the entry against its manifest, before a mount: the error names the file. A corrupt
        entry is removed (the next fill fetches it again); one that pods have mounted is marked corrupt
        (no longer mounted, counted or labelled as held) and removed as its last pod lets go."""
        path = self.entry(key)
        if path is None:
            raise CacheError(f"no complete cache entry {key}")
        manifest = read_manifest(path)
        if manifest is None:
            raise IntegrityError(f"cache entry {key}: no {MANIFEST_NAME}")
        ranks = _ranks_of(key)
        # Fingerprinted before the read: a write while it reads changes what the next mount compares. A file
        # changed within SETTLE_NS of this may change again within the same timestamp tick unseen, so such
        # an entry is verified but not stamped (git's "racily clean" index entries, the same rule).
        started, (files, newest_change) = self.clock(), _fingerprint(path)
        settled = time.time_ns() - newest_change >= SETTLE_NS
        try:
            wanted = select(manifest, ranks).entries
            check_sizes(path, wanted)
            read_files(path, wanted, ReadOptions())
        except IntegrityError:
            self._condemn(key)
            raise
        with self._lock(key):  # never a lock held across the read: mounts of the entry go on meanwhile
            if self.entry(key) is not None:
                self._stamp_verified(key, files if settled else None, started)

    def _condemn(self, key: str) -> None:
        """A corrupt entry: removed, or, while pods have it mounted, marked (no new mount gets it, the node's
        labels say it is gone) and removed as the last of them lets go (release)."""
        with self._lock(key):
            if self.entry(key) is None:
                return
            if not self.holders(key):
                self._remove(key, CORRUPT)
                return
            meta = self._meta(key)
            meta.pop("verified", None)
            meta.setdefault("corrupt", self.clock())
            self._write_meta(key, meta)
        self.on_change()

    def scrub(self, every: float) -> list[str]:
        """Verify every byte of each entry not verified within `every` seconds (bit rot that no write shows,
        which a mount inside the reverify window would not see); a corrupt or unreadable one is removed or
        marked (check). One entry at a time, holding no lock while it reads. Returns what was wrong."""
        problems = []
        for key in self.keys():
            meta = self._meta(key)
            if meta.get("corrupt") is not None or (meta.get("verified") or {}).get("at", float("-inf")) > \
                    self.clock() - every:
                continue  # known corrupt (going as its pods let go), or verified lately
            try:
                self.check(key)
            except IntegrityError as exc:
                held = self.holders(key)
                log.error("scrub: entry %s is corrupt (%s); %s", key, exc,
                          f"mounted by {', '.join(held)}: removed as they let go" if held else "removed")
                problems.append(f"{key}: {exc}")
            except OSError as exc:
                if self.entry(key) is None:
                    continue  # evicted while it was read
                log.error("scrub: entry %s cannot be read (%s): treated as corrupt", key, exc)
                self._condemn(key)  # a read error on the disk is rot too
                problems.append(f"{key}: {exc}")
        return problems

    # -- eviction --------------------------------------------------------------------------------------------
    def evict(self, needed: int = 0, keep: str | None = None) -> list[str]:
        """Remove least recently used entries (not held, not pinned, not `keep`) until `needed` more bytes
        fit under the low watermark and above the disk's floor; returns the keys removed."""
        removed = []
        candidates = sorted((k for k in self.keys() if k != keep and not self.holders(k)
                             and not self._meta(k).get("pinned")), key=lambda k: self._meta(k).get("lastUsed", 0))
        used, free = self.usage(), self.disk_free()
        for key in candidates:
            if used + needed <= self.marks.low and free - needed >= self.marks.keep_free:
                break
            with self._try_lock(key) as locked:
                if not locked or self.holders(key):
                    continue  # mounted (or being mounted) meanwhile: it stays
                nbytes = self._meta(key).get("bytes", 0)
                log.info("evicted %s (%d bytes, least recently used; the cache held %d, low watermark %d)",
                         key, nbytes, used, self.marks.low)
                self._remove(key, LEAST_RECENTLY_USED)
            used, free = used - nbytes, free + nbytes
            removed.append(key)
        return removed

    def remove(self, key: str) -> str:
        """Evict one entry now (an admin's `ferry cache evict --digest`), unless a pod has it mounted."""
        with self._lock(key):
            if self.entry(key) is None:
                raise CacheError(f"no cache entry {key}")
            if self.holders(key):
                raise CacheError(f"entry {key} is mounted by {', '.join(self.holders(key))}: let its pods go first")
            self._remove(key, REMOVED_BY_ADMIN)
            return key

    def _make_room(self, needed: int, key: str) -> None:
        if self._fits(needed):
            return
        # Evict only if that makes the fill fit: a fill that cannot fit anyway (a declared size larger than
        # the cache) must not empty the cache on its way to being refused.
        evictable = sum(self._meta(k).get("bytes", 0) for k in self.keys()
                        if k != key and not self.holders(k) and not self._meta(k).get("pinned"))
        if self._fits(needed - evictable):
            self.evict(needed, keep=key)
        if self._fits(needed):
            return
        used, free = self.usage(), self.disk_free()
        blocking = [k for k in self.keys() if self.holders(k) or self._meta(k).get("pinned")]
        why = (f"the cache holds {used} of its {self.marks.high}-byte high watermark"
               if used + needed > self.marks.high else
               f"the disk has {free} bytes free and must keep {self.marks.keep_free} (below that the kubelet "
               f"reports DiskPressure and evicts pods)")
        raise CacheFull(f"filling {key} needs {needed} more bytes; {why}, and {len(blocking)} entries that "
                        f"could go are mounted or pinned ({', '.join(blocking[:5]) or 'none'}): raise the "
                        f"watermark or free the disk, unpin an entry, or let its pods go")

    def _fit_share(self, namespace: str, needed: int, key: str) -> None:
        """Within the namespace's share, evicting only its own idle entries (least recently used first, and
        only if that makes it fit); else CacheFull with the numbers. Never another namespace's entry."""
        share = self.fairness.namespace_share
        if not share or not namespace:
            return
        used = self.namespace_usage(namespace, but=key)
        if used + needed <= share:
            return
        own = sorted((k for k in self.keys() if k != key and self._meta(k).get("namespace") == namespace
                      and not self.holders(k) and not self._meta(k).get("pinned")),
                     key=lambda k: self._meta(k).get("lastUsed", 0))
        if used - sum(self._meta(k).get("bytes", 0) for k in own) + needed <= share:
            for victim in own:
                if self.namespace_usage(namespace, but=key) + needed <= share:
                    break
                with self._try_lock(victim) as locked:
                    if locked and not self.holders(victim):
                        log.info("evicted %s of namespace %s to keep it within its share", victim, namespace)
                        self._remove(victim, LEAST_RECENTLY_USED)
            used = self.namespace_usage(namespace, but=key)
            if used + needed <= share:
                return
        raise CacheFull(f"filling {key} needs {needed} more bytes for namespace {namespace}, which holds {used} "
                        f"of its {share}-byte share of this node's cache (entries its pods filled, and fills under "
                        f"way); its other entries are mounted or pinned: let their pods go, or ask the cluster "
                        f"admin for a larger nodeCache.namespaceShare")

    def _fits(self, needed: int) -> bool:
        return (self.usage() + needed <= self.marks.high
                and self.disk_free() - needed >= self.marks.keep_free)

    def removals(self) -> dict[str, tuple[str, float]]:
        """Entries removed within REMOVAL_MEMORY_S and not filled again: key -> (why, when). The node's
        labels carry them for a while, so the operator can say why an artifact left a node."""
        out, now = {}, self.clock()
        for path in (self.root / "removed").iterdir():
            if path.name.startswith("."):
                continue  # a record being written (atomic_file's temporary name)
            try:
                record = json.loads(path.read_text())
                why, at = str(record["why"]), float(record["at"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # replaced this instant, or not ours: left alone
            if now - at > REMOVAL_MEMORY_S or self.entry(path.name) is not None:
                path.unlink(missing_ok=True)
            else:
                out[path.name] = (why, at)
        return out

    def _remove(self, key: str, why: str) -> None:
        path = self.root / "entries" / key
        if path.exists():
            doomed = self.root / "filling" / f".evicted-{key}-{uuid.uuid4().hex[:8]}"
            os.rename(path, doomed)  # gone from entries/ at once; the bytes go after
            _write_json(self.root / "removed" / key, {"why": why, "at": self.clock()})
            self.on_change()
            remove_tree(doomed)
        with contextlib.suppress(FileNotFoundError):
            self._meta_path(key).unlink()

    # -- internals -------------------------------------------------------------------------------------------
    def _meta_path(self, key: str) -> Path:
        return self.root / "meta" / f"{key}.json"

    def _write_meta(self, key: str, meta: dict) -> None:
        _write_json(self._meta_path(key), meta)

    def _meta(self, key: str) -> dict:
        try:
            return json.loads(self._meta_path(key).read_text())
        except FileNotFoundError:
            return {}

    @contextlib.contextmanager
    def _try_lock(self, key: str) -> Iterator[bool]:
        with open(self.root / "locks" / f"{key}.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False  # busy (a fill or a mount of it under way): not a candidate now
                return
            try:
                yield True
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        with open(self.root / "locks" / f"{key}.lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)


def source_manifest_bytes(source: Path, digest: str) -> bytes:
    """The source's manifest, trusted only if its sha256 is the digest the entry is keyed by."""
    data = read_manifest_bytes(source)  # never through a symlink, bounded
    if data is None:
        raise CacheError(f"{source} holds no {MANIFEST_NAME}: not a complete Ferry artifact")
    if not is_digest(data, digest):
        raise CacheError(f"{source / MANIFEST_NAME} has digest sha256:{hashlib.sha256(data).hexdigest()}, not "
                         f"{digest}: the artifact changed under its record")
    return data


def copy_into(staging: Path, source: Path, manifest_bytes: bytes, entries, on_bytes: OnBytes = lambda n: None,
              after_file: Callable[[str], None] = lambda name: None) -> None:
    """Copy `entries` of the artifact at `source` into `staging`, each verified as it is written, files
    side by side and a large file's segments in parallel. The manifest goes first under PENDING_MANIFEST
    (a killed fill is resumed against it) and under its own name last. `after_file` runs as each file is
    in place: the fault tests hold a fill there."""
    with atomic_file(staging / PENDING_MANIFEST) as f:
        f.write(manifest_bytes)
    read_files(source, entries, ReadOptions(), on_bytes, copy_to=staging, on_file=after_file)
    install_manifest(staging, manifest_bytes)


def keep_verified(staging: Path, wanted, digest: str) -> set[str]:
    """The files a killed fill left in `staging` that are whole and verified (local reads); everything
    else is removed: temporary files of an interrupted copy, corrupt files, strays, symlinks. Every file is
    reached beneath `staging` without following a symlink: nothing outside it is read, stat'ed or removed."""
    kept = {e.path for e in wanted if _verified_in_place(staging, e)}
    manifests = {name for name in (MANIFEST_NAME, PENDING_MANIFEST) if _slot_manifest(staging, name, digest)}
    _sweep(staging, kept | manifests)
    return kept


def _verified_in_place(staging: Path, entry) -> bool:
    """Whether the entry's file in `staging` is whole and verified; a wrong-sized or corrupt one is removed.
    One missing, behind a symlink or not a regular file is not kept (the sweep removes a link itself)."""
    try:
        with opened(staging, entry.path) as fd:
            size = os.fstat(fd).st_size
    except IntegrityError:
        return False
    if size == entry.size:  # bytes past the manifest's size would go unread: never kept
        try:
            read_files(staging, [entry], ReadOptions())
            return True
        except IntegrityError:
            pass
    unlink_beneath(staging, entry.path)
    return False


def _sweep(staging: Path, keep: set[str]) -> None:
    """Remove every symlink, and every regular file not in `keep`, under `staging` (slot_tree.walk: each
    directory opened relative to its parent without following a link, one fd per level, no recursion)."""
    def drop(dir_fd: int, name: str, st: os.stat_result, rel: str) -> None:
        if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and rel not in keep):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dir_fd)

    walk(staging, drop)


def _fingerprint(tree: Path) -> tuple[str, int]:
    """(what changes when any file of the tree is written, replaced, added or removed: each file's path,
    inode, size, mtime and ctime, which no one but the kernel sets, hashed; the newest of those times, ns)."""
    h, newest = hashlib.sha256(), 0
    for path in sorted(tree.rglob("*")):
        st = path.lstat()
        newest = max(newest, st.st_mtime_ns, st.st_ctime_ns)
        h.update(f"{path.relative_to(tree)}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode())
    return h.hexdigest(), newest


def _slot_manifest_bytes(staging: Path, digest: str) -> bytes | None:
    return next((data for name in (MANIFEST_NAME, PENDING_MANIFEST)
                 if (data := _slot_manifest(staging, name, digest)) is not None), None)


def _slot_manifest(staging: Path, name: str, digest: str) -> bytes | None:
    """The manifest a slot holds under `name` if it is a regular file (never a symlink, bounded) whose
    sha256 is `digest`; else None."""
    try:
        data = read_manifest_bytes(staging, name)
    except IntegrityError:
        return None
    return data if data is not None and is_digest(data, digest) else None


def install_manifest(staging: Path, manifest_bytes: bytes) -> None:
    with atomic_file(staging / MANIFEST_NAME) as f:
        f.write(manifest_bytes)
    with contextlib.suppress(FileNotFoundError):
        (staging / PENDING_MANIFEST).unlink()


def _open_to(key: str, staging: Path, dir_mode: int, file_mode: int | None = None, root_too: bool = True) -> None:
    """slot_tree.open_to on `key`'s staging directory (taken over, so within the walk's bounds): CacheError
    naming the key if it is not."""
    try:
        open_to(staging, dir_mode, file_mode, root_too=root_too)
    except TreeRefused as e:
        raise CacheError(f"the staging directory of {key} holds {e}: remove {staging} and fill again") from None


def is_digest(data: bytes, digest: str) -> bool:
    return hashlib.sha256(data).hexdigest() == digest.removeprefix("sha256:")


def _ranks_of(key: str) -> list[int] | None:
    _, _, ranks = key.partition(".ranks-")
    return [int(r) for r in ranks.split("-")] if ranks else None


def _safe(holder: str) -> str:
    if not holder or "/" in holder or holder.startswith("."):
        raise CacheError(f"holder {holder!r} must be a plain name (a pod uid)")
    return holder


def _write_json(path: Path, value: dict) -> None:
    with atomic_file(path) as f:
        f.write(json.dumps(value).encode())
