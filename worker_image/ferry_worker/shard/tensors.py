"""The safetensors container as byte ranges: where a tensor's bytes live in a
validated file, and the header of a file whose data the sharder streams itself.

Layout: an 8-byte little-endian header length, a JSON header mapping each name
to dtype, shape and [begin, end) within the data region, then the data region.
No tensor is ever materialized.
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..safetensors_header import DTYPE_BITS, UnsafeSafetensorsError, validate_safetensors
from .model import ShardError

METADATA = {"format": "pt"}  # what torch's save_file writes; transformers checks it


class SafetensorsError(ShardError):
    """A safetensors file is malformed or holds a dtype the sharder cannot slice."""


def itemsize(dtype: str) -> int:
    """Bytes per element; sub-byte dtypes (F4, F6) have no byte-addressable rows."""
    bits = DTYPE_BITS.get(dtype)
    if bits is None or bits % 8:
        raise SafetensorsError(f"dtype {dtype} is not byte-addressable; ferry shard cannot slice it")
    return bits // 8


@dataclass(frozen=True)
class TensorLocation:
    """`nbytes` bytes at absolute `offset` in `path` hold tensor `name`."""

    name: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def locate_tensors(path: Path) -> list[TensorLocation]:
    """Validate the header of `path` (offsets in bounds, no overlap, sizes that
    match shapes) and return where each tensor's bytes are."""
    try:
        header = validate_safetensors(path)
    except UnsafeSafetensorsError as e:
        raise SafetensorsError(str(e)) from None
    return [TensorLocation(t.name, path, t.dtype, t.shape, header.data_offset + t.begin, t.end - t.begin)
            for t in header.tensors]


@dataclass(frozen=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def encode_header(entries: Iterable[HeaderEntry]) -> bytes:
    """Length prefix + JSON header for tensors stored back to back in this order.

    The JSON is padded with spaces to a multiple of 8 bytes, as the safetensors
    library does, so the data region starts 8-byte aligned.
    """
    header: dict[str, object] = {"__metadata__": METADATA}
    position = 0
    for entry in entries:
        header[entry.name] = {"dtype": entry.dtype, "shape": list(entry.shape),
                              "data_offsets": [position, position + entry.nbytes]}
        position += entry.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


# Float dtypes a tensor may be widened from to float32 on its way into a rank file (shard/w8a8.py), exactly.
_NARROW = {"BF16": "<u2", "F16": "<f2", "F32": "<f4"}


def exactly_representable(value: int, dtype: str) -> bool:
    """Whether the integer `value` is exactly a `dtype` (BF16, F16, F32) value."""
    import numpy as np

    if dtype not in _NARROW or not -(1 << 24) <= value <= 1 << 24:
        return False
    f = np.array([value], dtype="<f4")
    if dtype == "BF16":
        return not (f.view("<u4") & 0xFFFF).any()
    return int(f.astype(_NARROW[dtype])[0]) == value


def widen(chunk, source: str, target: str) -> bytes:
    """`chunk` (whole elements of `source`) as `target` (F32): bf16 is the high half of a float32. An int64
    chunk (pack-quantized experts' weight_shape) becomes `target` (BF16, F16, F32) where each value is exact."""
    import numpy as np

    if source == target:
        return bytes(chunk)
    if source == "I64":
        ints = np.frombuffer(chunk, dtype="<i8")
        if target not in _NARROW or not all(exactly_representable(int(v), target) for v in ints):
            raise SafetensorsError(f"int64 values {ints[:4].tolist()} are not exactly {target} values")
        f = ints.astype("<f4")
        return (f.view("<u4") >> 16).astype("<u2").tobytes() if target == "BF16" else f.astype(_NARROW[target]).tobytes()
    if target != "F32" or source not in _NARROW:
        raise SafetensorsError(f"cannot widen {source} to {target}")
    if source == "BF16":
        return (np.frombuffer(chunk, dtype="<u2").astype("<u4") << 16).tobytes()
    return np.frombuffer(chunk, dtype=_NARROW[source]).astype("<f4").tobytes()


def narrow(chunk, stored: str, source: str) -> bytes:
    """The inverse of `widen`, refusing a value that `source` cannot hold exactly."""
    import numpy as np

    if stored == source:
        return bytes(chunk)
    if source == "I64" and stored in _NARROW:  # back from the experts' weight_shape in the model dtype
        words = np.frombuffer(chunk, dtype="<u2").astype("<u4") << 16 if stored == "BF16" else None
        values = words.view("<f4") if words is not None else np.frombuffer(chunk, dtype=_NARROW[stored]).astype("<f4")
        ints = values.astype("<i8")
        if not np.array_equal(ints.astype("<f4"), values):
            raise SafetensorsError(f"a {stored} weight_shape value is not an integer")
        return ints.tobytes()
    if stored != "F32" or source not in _NARROW:
        raise SafetensorsError(f"cannot narrow {stored} to {source}")
    values = np.frombuffer(chunk, dtype="<f4")
    if source == "BF16":
        words = values.view("<u4")
        if (words & 0xFFFF).any():
            raise SafetensorsError("a widened bf16 value has low bits set: it was not widened from bf16")
        return (words >> 16).astype("<u2").tobytes()
    narrowed = values.astype("<f2")
    if not np.array_equal(narrowed.astype("<f4").view("<u4"), values.view("<u4")):
        raise SafetensorsError("a widened fp16 value is not exactly an fp16 value")
    return narrowed.tobytes()
