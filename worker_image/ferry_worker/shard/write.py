"""Write planned rank files: streamed, hashed on the way, published atomically.

Each file is produced front to back by one thread: header, then every tensor's
pieces, read from the checkpoint in bounded blocks. The bytes pass through
the block hash (BLAKE3) on their way to disk, so the manifest costs no second read (which is
also why a kernel-side copy_file_range would not save anything here: the hash
needs the bytes in user space anyway). Each byte is hashed once, into its
64 MiB block's digest: the manifest records the block digests only, not also
a whole-file sha256 (a second pass over every byte, which cost this writer a
third of its time on 2 cores). Files are written in parallel, largest
first; `pread`/`write`, hashing and numpy gathers release the GIL. All rank
files of a cut read the same tensors at about the same time, so from a cold
page cache the checkpoint is read from disk about once.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Mapping

from ..manifest import SHARD_BLOCK_HASH, BlockHasher, FileEntry, atomic_file
from .plan import Columns, Constant, PlannedFile, PlannedTensor, Refined, Rows, ZeroRows
from .spans import BlockBuffers, Span, piece_span, read_side_by_side, read_span, zeros
from .tensors import HeaderEntry, TensorLocation, encode_header, itemsize, widen

OnBytes = Callable[[int], None]


class SourceFiles(contextlib.AbstractContextManager):
    """Read-only descriptors of the checkpoint files for one reader. Each
    writer opens its own: the kernel keeps readahead state per open file, and
    readers interleaving on one descriptor would defeat it."""

    def __init__(self, locations: Mapping[str, TensorLocation]):
        self.locations = locations
        self._fds: dict[Path, int] = {}
        for loc in locations.values():
            if loc.path not in self._fds:
                self._fds[loc.path] = os.open(loc.path, os.O_RDONLY)

    def fd(self, tensor: str) -> int:
        return self._fds[self.locations[tensor].path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


def data_order(tensors: tuple[PlannedTensor, ...]) -> list[PlannedTensor]:
    """Widest dtype first (as the safetensors library orders data), so every
    tensor starts aligned to its element size after the 8-aligned header."""
    return sorted(tensors, key=lambda t: -itemsize(t.dtype))


def header_for(planned: PlannedFile) -> bytes:
    return encode_header(HeaderEntry(t.name, t.dtype, t.shape) for t in data_order(planned.tensors))


def write_rank_files(files: tuple[PlannedFile, ...], directory: Path, locations: Mapping[str, TensorLocation], *,
                     jobs: int, on_bytes: OnBytes | None = None) -> list[FileEntry]:
    report = _serialized(on_bytes)
    ordered = sorted(files, key=lambda f: -f.data_bytes)
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(ordered)))) as pool:
        return list(pool.map(lambda f: write_rank_file(f, directory, locations, report), ordered))


def write_rank_file(planned: PlannedFile, directory: Path, locations: Mapping[str, TensorLocation],
                    on_bytes: OnBytes) -> FileEntry:
    digest, size = BlockHasher(SHARD_BLOCK_HASH), 0
    buffers = BlockBuffers()
    with SourceFiles(locations) as sources, atomic_file(directory / planned.name) as out:
        def emit(chunk: memoryview | bytes) -> None:
            nonlocal size
            digest.update(chunk)
            out.write(chunk)
            size += len(chunk)
            on_bytes(len(chunk))

        emit(header_for(planned))
        for tensor in data_order(planned.tensors):
            for chunk in tensor_bytes(tensor, sources, buffers):
                emit(chunk)
    return FileEntry(planned.name, size, blocks=digest.result(), block_hash=SHARD_BLOCK_HASH)


def tensor_bytes(tensor: PlannedTensor, sources: SourceFiles, buffers: BlockBuffers) -> Iterator[memoryview | bytes]:
    if tensor.axis == 1:  # each group's pieces side by side (an expert stack: one group per expert)
        for group in tensor.side_by_side():
            yield from read_side_by_side([(sources.fd(p.source), _span(p, sources)) for p in group])
        return
    row_bytes = tensor.nbytes // tensor.shape[0] if tensor.shape else tensor.nbytes
    for piece in tensor.pieces:
        if isinstance(piece, (Rows, Columns)):
            loc = sources.locations[piece.source]
            chunks = read_span(sources.fd(piece.source), piece_span(piece, loc.offset, loc.dtype, loc.shape), buffers)
            if loc.dtype == tensor.dtype:
                yield from chunks
            else:  # a scale vLLM allocates wider (w8a8): each chunk is whole elements
                yield from (widen(chunk, loc.dtype, tensor.dtype) for chunk in chunks)
        elif isinstance(piece, ZeroRows):
            yield from zeros(piece.count * row_bytes, buffers)
        elif isinstance(piece, Constant):
            yield piece.data
        elif isinstance(piece, Refined):
            yield refined_bytes(piece, sources, buffers)
        else:
            raise AssertionError(piece)


def refined_bytes(piece: Refined, sources: SourceFiles, buffers: BlockBuffers) -> bytes:
    """A refined-grid FP8 expert scale piece: the checkpoint scale (one expert's [N/bn, K/bk] float32, a few
    KiB) read whole, each value repeated over the finer blocks it covers, the rank's slice taken."""
    import numpy as np

    loc = sources.locations[piece.source]
    data = b"".join(bytes(c) for c in read_span(sources.fd(piece.source), Span(loc.offset, loc.nbytes), buffers))
    scale = np.frombuffer(data, dtype=np.uint8).reshape(*loc.shape, itemsize(loc.dtype))
    fine = scale.repeat(piece.factor[0], axis=0).repeat(piece.factor[1], axis=1)
    cut = fine[piece.start:piece.stop] if piece.axis == 0 else fine[:, piece.start:piece.stop]
    return np.ascontiguousarray(cut).tobytes()


def _span(piece: Rows | Columns, sources: SourceFiles) -> Span:
    loc = sources.locations[piece.source]
    return piece_span(piece, loc.offset, loc.dtype, loc.shape)


def _serialized(on_bytes: OnBytes | None) -> OnBytes:
    """Progress callbacks from several writer threads, one at a time."""
    if on_bytes is None:
        return lambda n: None
    lock = threading.Lock()

    def report(n: int) -> None:
        with lock:
            on_bytes(n)
    return report
