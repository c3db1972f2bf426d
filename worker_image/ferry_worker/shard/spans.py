"""Byte-level I/O for planned pieces, in bounded blocks.

A row slice of a row-major tensor is one contiguous byte range; a column slice
is `rows` runs of equal length, one row stride apart. Both are a `Span`. Reads
go through one caller-owned block buffer (plus one for gathering columns), so
memory stays at a few block sizes whatever the tensor size.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .model import ShardError
from .plan import Columns, Rows
from .tensors import itemsize

# Small enough to stay in the CPU cache between the read, the SHA-256 and the
# write of a block (measured: 4 MiB blocks made the copy half as fast).
BLOCK_BYTES = 1 << 20


@dataclass(frozen=True)
class Span:
    """`count` runs of `length` bytes, `stride` bytes apart, from `offset`."""

    offset: int
    length: int
    count: int = 1
    stride: int = 0

    @property
    def nbytes(self) -> int:
        return self.length * self.count

    @property
    def contiguous(self) -> bool:
        return self.count == 1 or self.stride == self.length


def piece_span(piece: Rows | Columns, offset: int, dtype: str, shape: tuple[int, ...]) -> Span:
    """Where the bytes of `piece` lie in a tensor of `dtype`/`shape` stored at `offset`."""
    row_bytes = itemsize(dtype) * math.prod(shape[1:])
    if isinstance(piece, Rows):
        return Span(offset + piece.start * row_bytes, (piece.stop - piece.start) * row_bytes)
    element = itemsize(dtype)
    return Span(offset + piece.start * element, (piece.stop - piece.start) * element,
                count=shape[0], stride=row_bytes)


class BlockBuffers:
    """The two block buffers one reader thread owns."""

    def __init__(self, block_bytes: int = BLOCK_BYTES):
        self.read = bytearray(block_bytes)
        self.gather = bytearray(block_bytes)

    @property
    def size(self) -> int:
        return len(self.read)


def read_span(fd: int, span: Span, buffers: BlockBuffers) -> Iterator[memoryview]:
    """Yield the bytes of `span` in order, in chunks of at most one block.

    A chunk is a view of `buffers`: consume it before asking for the next.
    """
    if span.contiguous:
        yield from _read_range(fd, span.offset, span.nbytes, buffers)
        return
    if span.stride > buffers.size:  # rows too long to batch: one run at a time
        for run in range(span.count):
            yield from _read_range(fd, span.offset + run * span.stride, span.length, buffers)
        return
    rows_per_block = buffers.size // span.stride
    source = np.frombuffer(buffers.read, dtype=np.uint8)
    gathered = np.frombuffer(buffers.gather, dtype=np.uint8)
    view = memoryview(buffers.gather)
    for first in range(0, span.count, rows_per_block):
        rows = min(rows_per_block, span.count - first)
        # Read whole rows (the runs of all other ranks included): one large
        # read beats `rows` small ones, and the bytes are in the page cache.
        needed = (rows - 1) * span.stride + span.length
        _pread_exactly(fd, memoryview(buffers.read)[:needed], span.offset + first * span.stride)
        runs = np.lib.stride_tricks.as_strided(source, shape=(rows, span.length), strides=(span.stride, 1))
        np.copyto(gathered[:rows * span.length].reshape(rows, span.length), runs)
        yield view[:rows * span.length]


def read_side_by_side(parts: list[tuple[int, Span]], block_bytes: int = BLOCK_BYTES) -> Iterator[memoryview]:
    """Yield the rows of the concatenation along dim 1 of `parts` ((fd, span) of column slices with the same
    row count), in chunks of whole rows: each part's runs of a block of rows read at once (as `read_span`
    does) and gathered side by side; rows longer than a block run by run. Memory: about two blocks."""
    count = parts[0][1].count
    width = sum(span.length for _, span in parts)
    if max(width, *(span.stride for _, span in parts)) > block_bytes:  # rows too long to batch: run by run
        buffers = BlockBuffers(block_bytes)
        for row in range(count):
            for fd, span in parts:
                yield from _read_range(fd, span.offset + row * span.stride, span.length, buffers)
        return
    rows_per_block = block_bytes // max(width, *(span.stride for _, span in parts))
    out = np.empty((rows_per_block, width), dtype=np.uint8)
    read = bytearray(rows_per_block * max(span.stride for _, span in parts))
    source = np.frombuffer(read, dtype=np.uint8)
    for first in range(0, count, rows_per_block):
        rows = min(rows_per_block, count - first)
        column = 0
        for fd, span in parts:
            needed = (rows - 1) * span.stride + span.length
            _pread_exactly(fd, memoryview(read)[:needed], span.offset + first * span.stride)
            runs = np.lib.stride_tricks.as_strided(source, shape=(rows, span.length), strides=(span.stride, 1))
            np.copyto(out[:rows, column:column + span.length], runs)
            column += span.length
        yield memoryview(out[:rows]).cast("B")


def write_span(fd: int, span: Span, data: memoryview, position: int) -> None:
    """Write `data`, the bytes of `span` from byte `position` of the span on, in place."""
    if span.contiguous:
        _pwrite_all(fd, data, span.offset + position)
        return
    while data:
        run, within = divmod(position, span.length)
        n = min(span.length - within, len(data))
        _pwrite_all(fd, data[:n], span.offset + run * span.stride + within)
        data, position = data[n:], position + n


def _read_range(fd: int, offset: int, length: int, buffers: BlockBuffers) -> Iterator[memoryview]:
    view = memoryview(buffers.read)
    for start in range(0, length, buffers.size):
        n = min(buffers.size, length - start)
        _pread_exactly(fd, view[:n], offset + start)
        yield view[:n]


def _pread_exactly(fd: int, into: memoryview, offset: int) -> None:
    while into:
        n = os.preadv(fd, [into], offset)
        if n == 0:
            raise ShardError(f"unexpected end of file at offset {offset}: was the checkpoint changed while "
                             f"being read?")
        into, offset = into[n:], offset + n


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def zeros(nbytes: int, buffers: BlockBuffers) -> Iterator[memoryview]:
    """`nbytes` zero bytes in block-sized chunks (vocabulary padding)."""
    np.frombuffer(buffers.gather, dtype=np.uint8)[:min(nbytes, buffers.size)].fill(0)
    view = memoryview(buffers.gather)
    for start in range(0, nbytes, buffers.size):
        yield view[:min(buffers.size, nbytes - start)]
