"""Validate a safetensors file from its header alone, before Ferry calls it complete.

Layout: 8 bytes little-endian header length N, N bytes of UTF-8 JSON
(`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`),
then the data region, which offsets index relative to its start.

A checkpoint from an untrusted source could claim a huge header (memory
exhaustion), offsets past the end of the file or overlapping tensors (readers
that trust offsets read the wrong bytes or out of bounds), or shapes whose
byte size disagrees with their extent. Each is refused here, reading only the
header, so validation costs nothing next to the transfer.

Every check is linear in the header (the tensor table is sorted once), and a
header is bounded twice before it costs anything: its length, read from the
8-byte prefix, against MAX_HEADER_BYTES before a byte of JSON is read; its
entries (tensors and `__metadata__` keys), counted while the top-level object
is parsed entry by entry, against MAX_HEADER_ENTRIES, so a header with a
million entries is refused at the cap instead of parsed in full. Below an
entry, values are decoded by the json module's C scanner: linear, and bounded
by the header length.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

# The safetensors library refuses headers above 100 MB; so does Ferry.
MAX_HEADER_BYTES = 100_000_000
# Tensors plus __metadata__ keys one header may hold. A real shard holds a few
# thousand tensors (DeepSeek-V3: ~1,000-5,000 per file); a whole large model in
# one file ~90,000 (DeepSeek-V3's 671B). 250,000 leaves room for that; a
# header with more exists to make parsing and checking expensive.
MAX_HEADER_ENTRIES = 250_000
# Dimensions of one tensor's shape. Frameworks stop at 64 (numpy 2, torch);
# the cap keeps the element count (a product of the dimensions) cheap.
MAX_TENSOR_RANK = 64
# JSON values a header may hold (a linear count of ',', '[' and '{' before any
# decoding): a real entry holds about eight, so this bounds the objects a
# decoded header can allocate (memory) at some 12 per allowed entry.
MAX_HEADER_TOKENS = 12 * MAX_HEADER_ENTRIES
TENSOR_KEYS = frozenset({"dtype", "shape", "data_offsets"})

# Bits per element. Sub-byte types pack several elements per byte.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E5M2": 8, "F8_E4M3": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip


class UnsafeSafetensorsError(Exception):
    """The file is not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the data region
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    data_offset: int  # absolute offset of the data region
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]


def validate_safetensors(path: Path | int, *, name: str | None = None) -> SafetensorsHeader:
    """Parse and check the header of `path` (or of an open fd, read from its current offset and left open);
    raise UnsafeSafetensorsError naming the problem."""
    label = name or str(path)
    with open(path, "rb", closefd=not isinstance(path, int)) as f:
        file_size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) < 8:
            raise UnsafeSafetensorsError(f"{label}: {file_size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES:
            raise UnsafeSafetensorsError(f"{label}: header length {header_len} exceeds {MAX_HEADER_BYTES} bytes")
        if 8 + header_len > file_size:
            raise UnsafeSafetensorsError(f"{label}: header length {header_len} runs past the end of the file ({file_size} bytes)")
        raw = f.read(header_len)
    return _check_header(raw, file_size, label)


def _check_header(raw: bytes, file_size: int, label: str) -> SafetensorsHeader:
    def fail(msg: str) -> UnsafeSafetensorsError:
        return UnsafeSafetensorsError(f"{label}: {msg}")

    if not raw.startswith(b"{"):
        raise fail("header is not a JSON object")
    tokens = raw.count(b",") + raw.count(b"[") + raw.count(b"{")
    if tokens > MAX_HEADER_TOKENS:
        raise fail(f"header holds about {tokens} JSON values, more than the {MAX_HEADER_TOKENS} Ferry decodes; "
                   "refused before decoding it")
    try:
        body = _parse_header_object(raw.decode("utf-8"), fail)
    except (UnicodeDecodeError, ValueError) as e:
        raise fail(f"header is not valid UTF-8 JSON: {e}") from None
    except RecursionError:
        raise fail("header is not valid UTF-8 JSON: values nested too deeply") from None

    metadata = body.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise fail("__metadata__ must map strings to strings")

    data_size = file_size - 8 - len(raw)
    tensors = [_check_tensor(name, entry, fail) for name, entry in body.items()]
    tensors.sort(key=lambda t: (t.begin, t.end))
    # Tensors must tile the data region exactly: no gap (unindexed bytes), no overlap.
    position = 0
    for t in tensors:
        if t.begin < position:
            raise fail(f"tensor {t.name!r} [{t.begin}, {t.end}) overlaps the previous tensor (ends at {position})")
        if t.begin > position:
            raise fail(f"bytes [{position}, {t.begin}) of the data region belong to no tensor")
        position = t.end
    if position != data_size:
        if position > data_size:
            raise fail(f"tensor data ends at {position}, past the end of the data region ({data_size} bytes)")
        raise fail(f"data region has {data_size} bytes but tensors cover only {position}")
    return SafetensorsHeader(data_offset=8 + len(raw), tensors=tuple(tensors), metadata=metadata)


def _check_tensor(name: str, entry: object, fail) -> TensorInfo:
    if not isinstance(entry, dict):
        raise fail(f"tensor {name!r}: entry is not an object")
    if not entry.keys() <= TENSOR_KEYS:
        unknown = sorted(entry.keys() - TENSOR_KEYS)
        raise fail(f"tensor {name!r}: unknown keys {_brief(unknown)} (a safetensors entry holds {sorted(TENSOR_KEYS)})")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise fail(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        raise fail(f"tensor {name!r}: shape must be a list of non-negative integers, got {_brief(shape)}")
    if len(shape) > MAX_TENSOR_RANK:
        raise fail(f"tensor {name!r}: shape has {len(shape)} dimensions, more than the {MAX_TENSOR_RANK} Ferry accepts")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise fail(f"tensor {name!r}: data_offsets must be [begin, end], got {offsets!r}")
    begin, end = offsets
    if end < begin:
        raise fail(f"tensor {name!r}: data_offsets end {end} < begin {begin}")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise fail(f"tensor {name!r}: {dtype} shape {shape} is not a whole number of bytes")
    if end - begin != bits // 8:
        raise fail(f"tensor {name!r}: {dtype} shape {shape} needs {bits // 8} bytes, data_offsets span {end - begin}")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _brief(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object nested in an entry; a repeated key is refused (one set, linear)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {duplicate!r}")
    return result


_WHITESPACE = re.compile(r"[ \t\n\r]*")  # what JSON allows between tokens
_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_keys)


def _parse_header_object(text: str, fail) -> dict:
    """The top-level JSON object, read entry by entry so that its entry count is
    refused at MAX_HEADER_ENTRIES, not after parsing everything behind it.
    `__metadata__` is read the same way and counts against the same cap."""
    budget = [MAX_HEADER_ENTRIES]  # entries still allowed, shared by the header and its __metadata__
    body, end = _parse_object(text, 0, fail, budget, top_level=True)
    if _skip_whitespace(text, end) != len(text):
        raise ValueError(f"extra data at char {_skip_whitespace(text, end)}")
    return body


def _parse_object(text: str, start: int, fail, budget: list[int], *, top_level: bool) -> tuple[dict, int]:
    """Parse the object at `start`; return it and the index after its `}`."""
    result: dict = {}
    i = _skip_whitespace(text, start + 1)
    if text.startswith("}", i):
        return result, i + 1
    while True:
        if not text.startswith('"', i):
            raise ValueError(f"expected a string key at char {i}")
        key, i = _DECODER.raw_decode(text, i)
        i = _skip_whitespace(text, i)
        if not text.startswith(":", i):
            raise ValueError(f"expected ':' at char {i}")
        i = _skip_whitespace(text, i + 1)
        if key in result:
            raise fail(f"duplicate key {key!r}")
        budget[0] -= 1
        if budget[0] < 0:
            raise fail(f"header holds more than {MAX_HEADER_ENTRIES} entries (tensors and __metadata__ keys), "
                       f"Ferry's cap; refused before reading the rest")
        if top_level and key == "__metadata__" and text.startswith("{", i):
            result[key], i = _parse_object(text, i, fail, budget, top_level=False)
        else:
            result[key], i = _DECODER.raw_decode(text, i)
        i = _skip_whitespace(text, i)
        if text.startswith("}", i):
            return result, i + 1
        if not text.startswith(",", i):
            raise ValueError(f"expected ',' or '}}' at char {i}")
        i = _skip_whitespace(text, i + 1)


def _skip_whitespace(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()
