"""SpoolFile: the seekable file tensorizer writes into, streamed out in parts."""
from __future__ import annotations

import io
import os

import pytest

from ferry_worker.tensorize.spool import SpoolFile

CHUNK = 64


def _spool():
    emitted: list[tuple[int, bytes]] = []
    return SpoolFile(CHUNK, lambda index, data: emitted.append((index, bytes(data)))), emitted


def _assemble(spool: SpoolFile, emitted) -> bytes:
    head, rest = spool.finish()
    parts = dict(emitted) | dict((i, bytes(d)) for i, d in rest) | {0: bytes(head)}
    return b"".join(parts[i] for i in sorted(parts))


def test_writes_seeks_and_patches_behave_like_a_file():
    spool, emitted = _spool()
    reference = io.BytesIO()
    data = os.urandom(1000)
    for f in (spool, reference):
        f.write(b"\0" * 40)            # a prologue, patched later
        f.write(data[:300])
        f.seek(10)
        f.write(b"PATCH")              # back into chunk 0
        f.seek(0, io.SEEK_END)
        f.write(data[300:])
        f.seek(340)
        f.write(b"late")               # a tensor header written after its data
        f.seek(0, io.SEEK_END)
    spool.seal()
    spool.seek(5)
    spool.write(b"head")              # chunk 0 stays writable until finish
    reference.seek(5)
    reference.write(b"head")
    assert spool.size == len(reference.getvalue())
    assert _assemble(spool, emitted) == reference.getvalue()
    assert [i for i, _ in emitted] == list(range(1, len(reference.getvalue()) // CHUNK))  # complete chunks only
    assert all(len(d) == CHUNK for _, d in emitted)


def test_only_complete_chunks_before_the_position_are_handed_over():
    spool, emitted = _spool()
    spool.write(b"x" * (3 * CHUNK + 10))
    spool.seek(2 * CHUNK + 5)           # the current tensor began here: nothing from here on is final
    spool.seal()
    assert [i for i, _ in emitted] == [1]
    spool.seek(0, io.SEEK_END)
    spool.seal()
    assert [i for i, _ in emitted] == [1, 2]
    head, rest = spool.finish()
    assert len(head) == CHUNK and [(i, len(d)) for i, d in rest] == [(3, 10)]


def test_a_write_into_an_uploaded_part_is_an_error_not_silent_corruption():
    spool, _ = _spool()
    spool.write(b"y" * (3 * CHUNK))
    spool.seal()
    spool.seek(CHUNK + 1)
    with pytest.raises(RuntimeError, match="already uploaded"):
        spool.write(b"z")


def test_a_small_file_is_chunk_zero_only():
    spool, emitted = _spool()
    spool.write(b"abc")
    spool.seal()
    head, rest = spool.finish()
    assert (bytes(head), rest, emitted) == (b"abc", [], [])


def test_it_looks_like_what_tensorizer_accepts():
    spool, _ = _spool()
    assert spool.readable() and spool.writable() and spool.seekable()
    with pytest.raises(io.UnsupportedOperation):
        spool.fileno()
    spool.close()  # TensorSerializer.close() closes it; finish() still works
    assert spool.finish() == (bytearray(), [])
