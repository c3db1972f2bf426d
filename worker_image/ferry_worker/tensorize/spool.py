"""A seekable, write-only file that streams to an object store in parts.

tensorizer's `TensorSerializer` needs a seekable file: it reserves a prologue
(file header and a 256 KiB metadata index) and patches it after every tensor,
and it writes each tensor's header (with its hashes) after the tensor's data.
`write_tensor` returns only once all of that tensor's writes are done, so
after it returns every byte before `tell()` is final except the prologue.

`SpoolFile` holds the file in chunks of `chunk_size` bytes: chunk 0 (which
holds the prologue; a chunk is at least 5 MiB, the prologue about 256 KiB)
stays in memory until `finish`; the caller calls `seal()` after each tensor,
which hands every complete chunk before `tell()` to `emit(index, data)` (an
upload of part index + 1) and forgets it. A write into a chunk already handed
over raises instead of silently corrupting the object. Memory: chunk 0, the
chunks of the tensor being written, and what `emit` keeps in flight.
"""
from __future__ import annotations

import io
from typing import Callable

Emit = Callable[[int, bytearray], None]


class SpoolFile(io.RawIOBase):
    def __init__(self, chunk_size: int, emit: Emit) -> None:
        super().__init__()
        self.chunk_size = chunk_size
        self._emit = emit
        self._chunks: dict[int, bytearray] = {}
        self._next_emit = 1  # chunks 1 .. _next_emit - 1 have been handed over
        self._pos = 0
        self._extent = 0

    # What TensorSerializer asks of a file object.
    def readable(self) -> bool:
        return True  # its mode check wants "wb+"; it never reads

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation("not an OS file")  # tensorizer then writes under a lock, in order

    def read(self, size: int = -1) -> bytes:
        raise io.UnsupportedOperation("SpoolFile is write-only")

    def readinto(self, buffer) -> int:
        raise io.UnsupportedOperation("SpoolFile is write-only")

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._extent}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n, position = len(view), self._pos
        while view:
            index, offset = divmod(position, self.chunk_size)
            if 0 < index < self._next_emit:
                raise RuntimeError(f"write at byte {position}, in part {index + 1}, which was already uploaded: "
                                   f"the serializer went back further than one tensor")
            chunk = self._chunks.get(index)
            if chunk is None:
                chunk = self._chunks[index] = bytearray(self.chunk_size)
            k = min(self.chunk_size - offset, len(view))
            chunk[offset:offset + k] = view[:k]
            view, position = view[k:], position + k
        self._pos = position
        self._extent = max(self._extent, position)
        return n

    def seal(self) -> None:
        """Everything before `tell()` is final (chunk 0 excepted): hand complete chunks over."""
        while (self._next_emit + 1) * self.chunk_size <= self._pos:
            index = self._next_emit
            chunk = self._chunks.pop(index, None)
            if chunk is None:  # nothing was written there (cannot happen with tensorizer): zeros
                chunk = bytearray(self.chunk_size)
            self._next_emit += 1
            self._emit(index, chunk)

    @property
    def size(self) -> int:
        return self._extent

    def finish(self) -> tuple[bytearray, list[tuple[int, bytearray]]]:
        """The final chunk 0 and the chunks not yet handed over, each cut to the file's end."""
        last = (self._extent - 1) // self.chunk_size if self._extent else 0
        rest = []
        for index in range(self._next_emit, last + 1):
            chunk = self._chunks.pop(index, None) or bytearray(self.chunk_size)
            rest.append((index, _cut(chunk, index, self.chunk_size, self._extent)))
        head = _cut(self._chunks.pop(0, bytearray(self.chunk_size)), 0, self.chunk_size, self._extent)
        self._next_emit = last + 1
        return head, rest

    def close(self) -> None:  # TensorSerializer.close() closes its file: that is not the end of the upload
        super().close()


def _cut(chunk: bytearray, index: int, chunk_size: int, extent: int) -> bytearray:
    end = min(chunk_size, extent - index * chunk_size)
    if end < len(chunk):
        del chunk[end:]
    return chunk
