"""The read stage: every byte of a set of files, read in parallel, checked
against its manifest entry (and optionally copied).

Measured on this machine's virtual disk, cold, a 1.1 GB rank file: one
sequential reader (`dd bs=16M`) 1.5 GB/s; 8-16 reads in flight at random
chunk offsets 1.4-1.8 GB/s; the file cut into 4 contiguous segments, each read
sequentially by its own thread (so the kernel's readahead works for each),
1.9 GB/s. So each file is read as segments, each by a thread of its own. The
page cache is the product: vLLM's own reads of the same files, moments later,
are served from memory, and a disk error fails the load instead of vLLM.

A file whose manifest entry has block digests (sharded_state rank files) is
verified by the segment readers themselves, each hashing its own blocks, so
one large file is hashed on every core at once; a copy of it (`--copy-to`,
the node cache's fills) is written by the same readers at their offsets and
published only once every block verified. Otherwise hashing (sha256 of the
whole file is sequential) and copying need the bytes in order: one consumer
per file reads it front to back — the first segment from the disk
itself, the rest mostly from the page cache the segment readers filled ahead
of it (hashlib releases the GIL, so files hash on several cores). Memory: one
chunk per thread.

Each file is opened beneath the root without following a symlink at any
component (manifest.opened), and its copy written beneath `copy_to` the same
way: a link a tenant planted in the artifact or the slot leads nowhere.
"""
from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Sequence

from ..manifest import BLOCK_SIZE, ContentCheck, FileEntry, IntegrityError, atomic_file, block_mismatch, opened

DEFAULT_CHUNK = 8 << 20
MIN_SEGMENT = 64 << 20  # smaller files are one segment: splitting them gains nothing


@dataclass(frozen=True)
class ReadOptions:
    readers: int = 16  # segment readers over all files
    chunk_size: int = DEFAULT_CHUNK
    segments: int = 4  # per file, at most
    files_at_once: int = 0  # 0: one per core, at least 2
    hash: bool = True  # sha256 every byte (else only read it)

    def at_once(self, files: int) -> int:
        at_once = self.files_at_once or max(2, os.cpu_count() or 2)
        return max(1, min(at_once, files, self.readers))

    def cut(self, size: int, at_once: int, align: int = 1) -> list[tuple[int, int]]:
        """[start, end) segments of a file of `size` bytes, starting at multiples of `align`."""
        n = max(1, min(self.segments, self.readers // at_once, size // max(MIN_SEGMENT, align)))
        if not size:
            return [(0, 0)]
        per = -(-size // n)
        step = -(-per // align) * align  # ceil(size / n), rounded up to a multiple of align
        return [(start, min(size, start + step)) for start in range(0, size, step)]


def read_files(root: Path, entries: Sequence[FileEntry], options: ReadOptions,
               on_bytes: Callable[[int], None] = lambda n: None, copy_to: Path | None = None,
               on_file: Callable[[str], None] = lambda path: None) -> None:
    """Read every entry under `root` (writing a copy under `copy_to` when set); with `options.hash`, check
    each against its manifest digest (block digests, else sha256), raising IntegrityError naming the file.
    `on_file` runs as each file is done (verified, and its copy published)."""
    if not entries:
        return
    at_once = options.at_once(len(entries))
    # Largest first: the long files start early and the short ones fill in behind them.
    ordered = sorted(entries, key=lambda e: -e.size)

    def one(e: FileEntry) -> None:
        with opened(root, e.path) as fd:
            _read_one(fd, e, options, at_once, on_bytes, copy_to)
        on_file(e.path)

    with ThreadPoolExecutor(at_once, thread_name_prefix="ferry-file") as files:
        futures = [files.submit(one, e) for e in ordered]
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _copy(copy_to: Path, entry: FileEntry):
    """The copy of `entry` under `copy_to`, its directories made or opened without following a symlink."""
    return atomic_file(copy_to / entry.path, beneath=copy_to)


def _read_one(fd: int, entry: FileEntry, options: ReadOptions, at_once: int,
              on_bytes: Callable[[int], None], copy_to: Path | None) -> None:
    if options.hash and entry.blocks:
        return _verify_blocks(fd, entry, options, at_once, on_bytes, copy_to)
    check = ContentCheck(entry) if options.hash else None
    consumer = check is not None or copy_to is not None
    segments = options.cut(entry.size, at_once)
    # With a consumer reading from the front, the first segment is its own.
    ahead = segments[1:] if consumer else segments
    with ThreadPoolExecutor(max(1, len(ahead)), thread_name_prefix="ferry-read") as readers:
        warm = [readers.submit(_read_range, fd, start, end, options.chunk_size, entry.path,
                               None if consumer else on_bytes) for start, end in ahead]
        try:
            if copy_to is None and check is not None:
                _consume(fd, entry, options.chunk_size, check, None, on_bytes)
                check.finish()
            elif copy_to is not None:
                with _copy(copy_to, entry) as out:
                    _consume(fd, entry, options.chunk_size, check, out, on_bytes)
                    if check is not None:
                        check.finish()  # before the rename: a bad copy is never published
        finally:
            for f in warm:
                f.result()  # a short read there is the file's error too


def _verify_blocks(fd: int, entry: FileEntry, options: ReadOptions, at_once: int,
                   on_bytes: Callable[[int], None], copy_to: Path | None = None) -> None:
    """Every block against its digest, segments in parallel (the block digests, under the manifest's own
    digest, vouch for the file; FileEntry has checked there is one per block). With `copy_to`, each segment
    reader also writes its bytes at their offsets into the copy's temporary file, which is published
    (renamed) only once every block verified."""
    segments = options.cut(entry.size, at_once, align=BLOCK_SIZE)
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(_copy(copy_to, entry)).fileno() if copy_to is not None else None
        with ThreadPoolExecutor(len(segments), thread_name_prefix="ferry-verify") as readers:
            for f in [readers.submit(_verify_range, fd, start, end, options.chunk_size, entry, on_bytes, out)
                      for start, end in segments]:
                f.result()


def _verify_range(fd: int, start: int, end: int, chunk: int, entry: FileEntry,
                  on_bytes: Callable[[int], None], out: int | None = None) -> None:
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
    buf = memoryview(bytearray(min(chunk, BLOCK_SIZE)))
    # range(start, max(end, start + 1)): an empty file still has its one block, the digest of nothing.
    for block_start in range(start, max(end, start + 1), BLOCK_SIZE):
        block_end = min(end, block_start + BLOCK_SIZE)
        h = entry.block_hasher()
        offset = block_start
        while offset < block_end:
            n = _pread_exactly(fd, buf[:min(len(buf), block_end - offset)], offset, entry.path)
            h.update(buf[:n])
            if out is not None:
                _pwrite_all(out, buf[:n], offset)
            offset += n
            on_bytes(n)
        index = block_start // BLOCK_SIZE
        if h.hexdigest() != entry.blocks[index]:
            raise block_mismatch(entry, index, h.hexdigest())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _read_range(fd: int, start: int, end: int, chunk: int, name: str,
                on_bytes: Callable[[int], None] | None) -> None:
    # The kernel's readahead, doubled, for this sequential stream.
    os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
    buf = memoryview(bytearray(chunk))
    offset = start
    while offset < end:
        n = _pread_exactly(fd, buf[:min(chunk, end - offset)], offset, name)
        offset += n
        if on_bytes is not None:
            on_bytes(n)


def _consume(fd: int, entry: FileEntry, chunk: int, check: ContentCheck | None, out: BinaryIO | None,
             on_bytes: Callable[[int], None]) -> None:
    buf = memoryview(bytearray(chunk))
    offset = 0
    while offset < entry.size:
        n = _pread_exactly(fd, buf[:min(chunk, entry.size - offset)], offset, entry.path)
        view = buf[:n]
        if check is not None:
            check.update(view)  # hashlib releases the GIL
        if out is not None:
            out.write(view)
        offset += n
        on_bytes(n)


def _pread_exactly(fd: int, view: memoryview, offset: int, name: str) -> int:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise IntegrityError(f"{name}: ended at byte {offset + done}, the manifest says {offset + len(view)} or "
                                 "more (truncated while being read?)")
        done += n
    return len(view)
