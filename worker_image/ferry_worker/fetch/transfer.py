"""The transfer engine: files from a source into the output directory, verified.

Per file, on a controller thread (`files_in_flight` at once for ranged
sources, `concurrency` for download sources):

- ranged sources: the file is cut into parts fetched by a shared pool of
  `concurrency` threads; each part is written in place (`pwrite`) into a
  partial file as it streams, through a reused buffer, so memory stays bounded
  whatever the model size. The controller hashes the contiguous prefix as it
  grows, reading it back from the page cache: hashing overlaps the transfer
  and ends with it. Every `checkpoint_bytes` a sync thread fsyncs and
  journals that prefix, which is where a killed fetch resumes.
- download sources (the Hub): the source's client writes the partial file,
  then the controller hashes it.

Then: size and every advertised digest checked, a `.safetensors` header
validated, the partial file fsynced and renamed into place, and the journal
updated. A failed check deletes the partial file: bad bytes are never resumed.
Files already complete from an earlier run are re-hashed and kept.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..manifest import HASH_CHUNK, FileEntry, IntegrityError, fsync_dir, partial_name
from ..paths import inside
from ..progress import Progress
from ..safetensors_header import validate_safetensors
from ..sources import DownloadSource, RangedSource, RemoteFile, Source, SourceError
from .digests import ContentHasher, check_advertised
from .journal import Journal

log = logging.getLogger(__name__)

READ_BUFFER = 4 << 20  # per part-worker thread
CHECKPOINT_PARTS = 8
RETRY_BACKOFF_S = 1.0


def default_concurrency() -> int:
    """One ranged read per core the worker may use, 2 to 16.

    Receiving, hashing (sha256 + the store's checksum) and writing are CPU
    work: with more streams than cores they only contend (measured on two
    cores: 8 streams 0.78x boto3's download_file, 2 streams 1.22x); 16
    streams already saturate a fast link on big nodes.
    """
    return max(2, min(16, len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class TransferOptions:
    # Parallel ranged reads; for download sources, parallel files.
    concurrency: int = field(default_factory=default_concurrency)
    part_size: int = 32 << 20
    # Ranged sources, two files at a time: the parts of the next file keep the
    # pool busy while the last parts of the current one are hashed and fsynced,
    # and fewer files in flight mean a shorter unhashed backlog and less dirty
    # page cache.
    files_in_flight: int = 2
    max_bandwidth: float | None = None  # bytes/s over all transfers; None: unlimited
    retries: int = 3  # per part, on the source's transient errors

    @property
    def checkpoint_bytes(self) -> int:
        """How much hashed prefix may be lost to a kill: a few parts (fsync is not free)."""
        return CHECKPOINT_PARTS * self.part_size


class Aborted(Exception):
    """Another file failed; this one stops early."""


class RateLimiter:
    """Spaces out byte consumption to `rate` bytes/s across threads (a virtual-time schedule)."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._lock = threading.Lock()
        self._next_free = time.monotonic()

    def consume(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next_free)
            self._next_free = start + n / self._rate
        if start > now:
            time.sleep(start - now)


class _Assembly:
    """Parts of one file being written concurrently; tracks the contiguous written prefix."""

    def __init__(self, start: int, end: int, part_size: int) -> None:
        self.start = start
        self.parts = [(s, min(s + part_size, end)) for s in range(start, end, part_size)]
        self._written = [0] * len(self.parts)
        self._next = 0  # first part not yet fully written
        self._end = end
        self.frontier = start
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.cancelled = False

    def mark(self, index: int, n: int) -> None:
        with self.cond:
            self._written[index] += n
            while self._next < len(self.parts) and self._written[self._next] == self._length(self._next):
                self._next += 1
            self.frontier = (
                self.parts[self._next][0] + self._written[self._next] if self._next < len(self.parts) else self._end
            )
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    def wait_beyond(self, position: int, abort: threading.Event) -> int:
        with self.cond:
            while self.frontier <= position and self.error is None and not abort.is_set():
                self.cond.wait(0.2)
            if self.error is not None:
                raise self.error
            if abort.is_set():
                raise Aborted()
            return self.frontier

    def _length(self, index: int) -> int:
        start, end = self.parts[index]
        return end - start


class TransferEngine:
    def __init__(self, source: Source, output: Path, journal: Journal, progress: Progress,
                 options: TransferOptions = TransferOptions()) -> None:
        self._source = source
        self._output = output
        self._journal = journal
        self._progress = progress
        self._options = options
        self._limiter = RateLimiter(options.max_bandwidth) if options.max_bandwidth else None
        self._abort = threading.Event()
        self._buffers = threading.local()
        # The pools of the running fetch(): ranged parts, and checkpoint fsyncs.
        self._parts: ThreadPoolExecutor | None = None
        self._syncer: ThreadPoolExecutor | None = None

    def fetch(self, files: Sequence[RemoteFile]) -> list[FileEntry]:
        """Fetch `files`; return their manifest entries, or raise the first failure."""
        files_at_once = (
            self._options.files_in_flight if isinstance(self._source, RangedSource) else self._options.concurrency
        )
        with ThreadPoolExecutor(self._options.concurrency, thread_name_prefix="ferry-part") as parts, \
                ThreadPoolExecutor(1, thread_name_prefix="ferry-sync") as syncer, \
                ThreadPoolExecutor(files_at_once, thread_name_prefix="ferry-file") as controllers:
            self._parts, self._syncer = parts, syncer
            futures = [controllers.submit(self._fetch_file, f) for f in files]
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            if _first_failure(futures) is not None:
                self._abort.set()  # the other files stop at their next chunk
                for future in pending:
                    future.cancel()
                wait(futures)
                raise _first_failure(futures)
        return sorted((f.result() for f in futures), key=lambda e: e.path)

    def _fetch_file(self, file: RemoteFile) -> FileEntry:
        if self._abort.is_set():
            raise Aborted()
        final = inside(self._output, file.path)
        kept = self._keep_complete(file, final)
        if kept is not None:
            return kept
        file = self._source.describe(file)  # the content check of a file that is really transferred
        partial = partial_name(final)
        partial.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(self._source, RangedSource):
            hasher = self._fetch_ranged(self._source, file, partial)
        elif isinstance(self._source, DownloadSource):
            hasher = self._fetch_download(self._source, file, partial)
        else:
            raise TypeError(f"{type(self._source).__name__} is neither a ranged nor a download source")
        return self._publish(file, partial, final, hasher)

    def _keep_complete(self, file: RemoteFile, final: Path) -> FileEntry | None:
        """A file an earlier run completed, unchanged at the source and on disk, is kept."""
        recorded = self._journal.completed_sha256(file.path, file.version, file.size)
        if recorded is None or not final.is_file() or final.stat().st_size != file.size:
            return None
        hasher = ContentHasher(file.size)
        with open(final, "rb", buffering=0) as f:
            self._hash_range(f.fileno(), 0, file.size, hasher, count_progress=True)
        sha256 = hasher.hexdigests()["sha256"]
        if sha256 == recorded and file.sha256 in (None, sha256):
            return FileEntry(file.path, file.size, sha256)
        log.warning("%s changed on disk since it was fetched; fetching it again", file.path)
        self._progress.advance(-file.size)
        final.unlink()
        return None

    def _fetch_ranged(self, source: RangedSource, file: RemoteFile, partial: Path) -> ContentHasher:
        durable = self._journal.durable_bytes(file.path, file.version, file.size)
        if durable and (not partial.exists() or partial.stat().st_size < durable):
            durable = 0
        hasher = ContentHasher(file.size, file.digests)
        fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
        assembly: _Assembly | None = None
        futures: list[Future] = []
        try:
            if not durable:
                os.ftruncate(fd, 0)  # drop whatever an unjournaled earlier attempt left
            os.ftruncate(fd, file.size)
            if durable:
                log.info("resuming %s at byte %d of %d", file.path, durable, file.size)
                self._hash_range(fd, 0, durable, hasher, count_progress=True)
            assembly = _Assembly(durable, file.size, self._options.part_size)
            assert self._parts is not None
            futures = [
                self._parts.submit(self._fetch_part, source, file, fd, assembly, i) for i in range(len(assembly.parts))
            ]
            self._hash_as_written(fd, file, assembly, hasher, futures)
            os.fsync(fd)
        except BaseException:
            if assembly is not None:
                assembly.cancelled = True
            for future in futures:
                future.cancel()
            wait(futures)  # no part or checkpoint may still use fd once it is closed
            raise
        finally:
            os.close(fd)
        return hasher

    def _hash_as_written(self, fd: int, file: RemoteFile, assembly: _Assembly, hasher: ContentHasher,
                         futures: list[Future]) -> None:
        """Hash the contiguous written prefix as it grows; checkpoint it every `checkpoint_bytes`."""
        assert self._syncer is not None
        hashed = checkpointed = assembly.start
        checkpoint: Future | None = None
        while hashed < file.size:
            frontier = assembly.wait_beyond(hashed, self._abort)
            self._hash_range(fd, hashed, frontier, hasher)
            hashed = frontier
            due = hashed - checkpointed >= self._options.checkpoint_bytes and hashed < file.size
            if due and (checkpoint is None or checkpoint.done()):
                if checkpoint is not None:
                    checkpoint.result()  # an fsync error surfaces here
                # On the sync thread: the fsync waits for the disk, hashing goes on.
                checkpoint = self._syncer.submit(self._checkpoint, fd, file, hashed)
                futures.append(checkpoint)  # the caller waits for it before closing fd
                checkpointed = hashed
        if checkpoint is not None:
            checkpoint.result()

    def _checkpoint(self, fd: int, file: RemoteFile, prefix: int) -> None:
        """Make the hashed prefix durable and journal it: where a killed fetch resumes."""
        os.fdatasync(fd)
        self._journal.record_partial(file.path, file.version, file.size, prefix)

    def _fetch_part(self, source: RangedSource, file: RemoteFile, fd: int, assembly: _Assembly, index: int) -> None:
        start, end = assembly.parts[index]
        position, failures = start, 0
        buffer = self._buffer("read_buffer", READ_BUFFER)
        try:
            while position < end:
                try:
                    for chunk in source.read_range(file, position, end, buffer):
                        if assembly.cancelled or self._abort.is_set():
                            raise Aborted()
                        if self._limiter is not None:
                            self._limiter.consume(len(chunk))
                        _pwrite_all(fd, chunk, position)
                        position += len(chunk)
                        assembly.mark(index, len(chunk))
                        self._progress.advance(len(chunk))
                except source.transient_errors as e:
                    failures += 1
                    if failures > self._options.retries:
                        raise SourceError(f"{source.uri}: {file.path}: giving up at byte {position} after {failures} failures: {e}") from e
                    log.warning("%s: retrying at byte %d after: %s", file.path, position, e)
                    time.sleep(RETRY_BACKOFF_S * failures)
                except (SourceError, Aborted):
                    raise
                except Exception as e:  # e.g. access denied: say which file
                    raise SourceError(f"{source.uri}: {file.path}: {e}") from e
        except BaseException as e:
            assembly.fail(e)
            raise

    def _fetch_download(self, source: DownloadSource, file: RemoteFile, partial: Path) -> ContentHasher:
        try:
            source.download(file, partial, self._progress.advance)
        except Exception as e:  # the client's message may not say which file
            raise SourceError(f"{source.uri}: {file.path}: {e}") from e
        hasher = ContentHasher(file.size, file.digests)
        with open(partial, "rb", buffering=0) as f:
            self._hash_range(f.fileno(), 0, os.fstat(f.fileno()).st_size, hasher)
            os.fsync(f.fileno())
        return hasher

    def _publish(self, file: RemoteFile, partial: Path, final: Path, hasher: ContentHasher) -> FileEntry:
        try:
            size = partial.stat().st_size
            if size != file.size:
                raise IntegrityError(f"{file.path}: {size} bytes, the source advertised {file.size}")
            computed = hasher.hexdigests()
            check_advertised(file.path, computed, file.sha256, file.digests, self._source.uri)
            if final.suffix == ".safetensors":
                validate_safetensors(partial, name=file.path)
        except Exception:
            # Never resume from bytes that failed a check.
            partial.unlink(missing_ok=True)
            self._journal.forget(file.path)
            raise
        os.replace(partial, final)
        fsync_dir(final.parent)
        self._journal.record_complete(file.path, file.version, file.size, computed["sha256"])
        return FileEntry(file.path, file.size, computed["sha256"])

    def _hash_range(self, fd: int, start: int, end: int, hasher: ContentHasher, count_progress: bool = False) -> None:
        """Hash bytes [start, end) of fd, read back (from the page cache, for what was just written).

        Hashed bytes are then let go of with POSIX_FADV_DONTNEED: on Linux that
        starts their writeback now, overlapping the disk with the transfer
        instead of leaving it all to the final fsync, and keeps a checkpoint
        of any size from filling the node's page cache (on the 2-core dev
        machine, fetches were measurably slower without it: dirty-page reclaim).
        """
        buffer = self._buffer("hash_buffer", HASH_CHUNK)
        position = start
        while position < end:
            n = os.preadv(fd, [buffer[: min(len(buffer), end - position)]], position)
            if n == 0:
                raise IntegrityError(f"unexpected end of file at byte {position}, expected {end}")
            hasher.update(buffer[:n])
            os.posix_fadvise(fd, position, n, os.POSIX_FADV_DONTNEED)
            position += n
            if count_progress:
                self._progress.advance(n)

    def _buffer(self, kind: str, size: int) -> memoryview:
        """This thread's reusable buffer of `kind` (a part worker's reads, a controller's hashing)."""
        buffer = getattr(self._buffers, kind, None)
        if buffer is None:
            buffer = memoryview(bytearray(size))
            setattr(self._buffers, kind, buffer)
        return buffer


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _first_failure(futures: list[Future]) -> BaseException | None:
    """The error that caused the failure (not the Aborted it triggered in other files)."""
    errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
    real = [e for e in errors if not isinstance(e, Aborted)]
    return (real or errors or [None])[0]
