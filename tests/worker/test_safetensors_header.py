"""Header validation refuses hostile or inconsistent safetensors files, reading only the header."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoint_files import raw_safetensors
from ferry_worker.safetensors_header import MAX_HEADER_BYTES, UnsafeSafetensorsError, validate_safetensors


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_a_file_written_by_the_safetensors_library_is_valid(tmp_path: Path) -> None:
    path = tmp_path / "lib.safetensors"
    save_file({"w": np.zeros((3, 5), np.float32), "b": np.zeros((7,), np.int8), "e": np.zeros((0, 4), np.float16)},
              str(path), metadata={"format": "pt"})
    header = validate_safetensors(path)
    assert {t.name: (t.dtype, t.shape) for t in header.tensors} == {
        "w": ("F32", (3, 5)), "b": ("I8", (7,)), "e": ("F16", (0, 4))}
    assert header.metadata == {"format": "pt"}
    assert header.data_offset + 60 + 7 == path.stat().st_size


def test_sub_byte_dtypes_are_sized_in_bits(tmp_path: Path) -> None:
    validate_safetensors(write(tmp_path, raw_safetensors({"q": entry("F4", [2, 3], 0, 3)}, b"\0" * 3)))
    with pytest.raises(UnsafeSafetensorsError, match="whole number of bytes"):
        validate_safetensors(write(tmp_path, raw_safetensors({"q": entry("F4", [3], 0, 2)}, b"\0" * 2)))


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"\x01\x02", "too short"),
        (struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "exceeds"),
        (struct.pack("<Q", 1 << 62) + b"{}", "exceeds"),
        (struct.pack("<Q", 4096) + b"{}", "past the end of the file"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 4) + b"{\xff\xfe}", "UTF-8 JSON"),
        (struct.pack("<Q", 10) + b'{"a": 1, "', "UTF-8 JSON"),
    ],
    ids=["short", "huge-length", "absurd-length", "length-past-eof", "not-object", "not-utf8", "truncated-json"],
)
def test_malformed_prefix_or_header(tmp_path: Path, data: bytes, problem: str) -> None:
    with pytest.raises(UnsafeSafetensorsError, match=problem):
        validate_safetensors(write(tmp_path, data))


@pytest.mark.parametrize(
    "header, data, problem",
    [
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}, 12, "overlaps"),
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 16, 24)}, 24, r"bytes \[8, 16\).*no tensor"),
        ({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 8, 16)}, 8, "past the end of the data region"),
        ({"a": entry("F32", [2], 0, 8)}, 12, "cover only 8"),
        ({"a": entry("F32", [2], 1 << 40, (1 << 40) + 8)}, 8, "no tensor"),
        ({"a": entry("F32", [3], 0, 8)}, 8, "needs 12 bytes"),
        ({"a": entry("F32", [2], 8, 0)}, 8, "end 0 < begin 8"),
        ({"a": entry("F31", [2], 0, 8)}, 8, "unknown dtype"),
        ({"a": entry("F32", [-2], 0, 8)}, 8, "shape"),
        ({"a": entry("F32", [True, 2], 0, 8)}, 8, "shape"),
        ({"a": entry("F32", [2], 0, 8.0)}, 8, "data_offsets"),
        ({"a": {"dtype": "F32", "shape": [2]}}, 8, "data_offsets"),
        ({"a": [1, 2]}, 8, "not an object"),
    ],
    ids=["overlap", "gap", "offsets-out-of-bounds", "unindexed-tail", "offset-far-beyond", "shape-size-mismatch",
         "reversed", "dtype", "negative-dim", "bool-dim", "float-offset", "no-offsets", "entry-type"],
)
def test_inconsistent_tensor_table(tmp_path: Path, header: dict, data: int, problem: str) -> None:
    with pytest.raises(UnsafeSafetensorsError, match=problem):
        validate_safetensors(write(tmp_path, raw_safetensors(header, b"\0" * data)))


def test_duplicate_tensor_names_are_refused(tmp_path: Path) -> None:
    body = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, ' \
           b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}}'
    with pytest.raises(UnsafeSafetensorsError, match="duplicate key 'a'"):
        validate_safetensors(write(tmp_path, struct.pack("<Q", len(body)) + body + b"\0\0"))


def test_metadata_must_be_strings(tmp_path: Path) -> None:
    with pytest.raises(UnsafeSafetensorsError, match="__metadata__"):
        validate_safetensors(write(tmp_path, raw_safetensors({}, b"", metadata={"n": 1})))


def test_the_error_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(UnsafeSafetensorsError, match=r"^model-00001-of-00002\.safetensors: "):
        validate_safetensors(write(tmp_path, b"\0" * 4), name="model-00001-of-00002.safetensors")
