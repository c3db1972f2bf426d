"""Bounded-block reads and writes of row and column slices, at block sizes
small enough to exercise every branch (a block holding many rows, rows longer
than a block, ranges spanning several blocks)."""
from __future__ import annotations

import numpy as np
import pytest

from ferry_worker.shard.plan import Columns, Rows
from ferry_worker.shard.spans import BlockBuffers, Span, piece_span, read_side_by_side, read_span, write_span

MATRIX = np.arange(12 * 40, dtype=np.uint16).reshape(12, 40)  # 80-byte rows
OFFSET = 24  # the tensor sits after some other bytes in its file


@pytest.fixture
def matrix_file(tmp_path):
    path = tmp_path / "tensor.bin"
    path.write_bytes(b"x" * OFFSET + MATRIX.tobytes())
    with open(path, "rb") as f:
        yield f.fileno()


@pytest.mark.parametrize("block", [16, 64, 100, 4096])
@pytest.mark.parametrize("piece, expected", [
    (Rows("t", 3, 11), MATRIX[3:11]),
    (Columns("t", 10, 30), MATRIX[:, 10:30]),
    (Columns("t", 0, 40), MATRIX),
    (Columns("t", 39, 40), MATRIX[:, 39:]),
])
def test_read_span_yields_the_slice_in_order(matrix_file, block, piece, expected):
    span = piece_span(piece, OFFSET, "BF16", MATRIX.shape)
    chunks = [bytes(c) for c in read_span(matrix_file, span, BlockBuffers(block))]
    assert all(len(c) <= block for c in chunks)
    assert b"".join(chunks) == np.ascontiguousarray(expected).tobytes()


@pytest.mark.parametrize("block", [16, 64, 100, 200, 4096])
def test_read_side_by_side_concatenates_column_slices_along_dim_1(matrix_file, block):
    """An [in, out] tensor's fused parts (AWQ, GPTQ): each row is the parts' runs in order. Blocks below a
    row's 80 bytes go run by run, reading no more than a block at a time."""
    pieces = [Columns("t", 30, 40), Columns("t", 0, 5), Columns("t", 12, 13)]
    parts = [(matrix_file, piece_span(p, OFFSET, "BF16", MATRIX.shape)) for p in pieces]
    chunks = [bytes(c) for c in read_side_by_side(parts, block)]
    expected = np.concatenate([MATRIX[:, 30:40], MATRIX[:, 0:5], MATRIX[:, 12:13]], axis=1)
    assert b"".join(chunks) == np.ascontiguousarray(expected).tobytes()
    assert all(len(c) <= max(block, 32) for c in chunks)  # whole rows of 32 bytes when a block holds one


@pytest.mark.parametrize("piece", [Rows("t", 2, 9), Columns("t", 5, 25)])
def test_write_span_puts_a_stream_back_in_place(tmp_path, piece):
    path = tmp_path / "out.bin"
    path.write_bytes(bytes(OFFSET + MATRIX.nbytes))
    span = piece_span(piece, OFFSET, "BF16", MATRIX.shape)
    stream = np.ascontiguousarray(MATRIX[2:9] if isinstance(piece, Rows) else MATRIX[:, 5:25]).tobytes()
    with open(path, "r+b") as f:
        for start in range(0, len(stream), 7):  # odd chunks that straddle runs
            write_span(f.fileno(), span, memoryview(stream[start:start + 7]), start)
    rebuilt = np.frombuffer(path.read_bytes()[OFFSET:], dtype=np.uint16).reshape(MATRIX.shape)
    region = (slice(2, 9), slice(None)) if isinstance(piece, Rows) else (slice(None), slice(5, 25))
    assert (rebuilt[region] == MATRIX[region]).all()
    untouched = np.ones(MATRIX.shape, dtype=bool)
    untouched[region] = False
    assert not rebuilt[untouched].any()


def test_span_of_a_vector_is_contiguous():
    assert piece_span(Rows("b", 4, 8), 100, "F16", (16,)) == Span(108, 8)
