"""Header validation refuses hostile or inconsistent safetensors files, reading only the header."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoint_files import raw_safetensors
from ferry_worker import safetensors_header
from ferry_worker.safetensors_header import (
    MAX_HEADER_BYTES, MAX_HEADER_ENTRIES, MAX_TENSOR_RANK, UnsafeSafetensorsError, validate_safetensors)


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


def one_byte_tensors(count: int, *, tail: str = "}") -> bytes:
    """`count` U8[1] tensors, written by hand: the test needs headers json.dumps would not make."""
    body = ",".join(f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(count))
    raw = ("{" + body + tail).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * count


def test_a_million_entries_are_refused_at_the_cap_before_the_rest_is_parsed(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The JSON is broken after the last entry: a parser that read everything before
    # counting would report that instead of the cap.
    data = one_byte_tensors(1_000_000, tail=', "broken')
    assert len(data) < MAX_HEADER_BYTES  # within the size cap: the entry cap is what refuses it
    with pytest.raises(UnsafeSafetensorsError) as refused:
        validate_safetensors(write(tmp_path, data), name="model-00001-of-00002.safetensors")
    # The linear count of JSON values comes first: refused before anything is decoded.
    assert str(refused.value).startswith("model-00001-of-00002.safetensors: header holds about ")
    assert "refused before decoding it" in str(refused.value)
    # Past the value count too, the entry cap stops the parse at the cap.
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_TOKENS", 10**9)
    with pytest.raises(UnsafeSafetensorsError) as refused:
        validate_safetensors(write(tmp_path, data), name="model-00001-of-00002.safetensors")
    assert str(refused.value) == (
        f"model-00001-of-00002.safetensors: header holds more than {MAX_HEADER_ENTRIES} entries "
        f"(tensors and __metadata__ keys), Ferry's cap; refused before reading the rest")


def test_one_entry_that_would_decode_into_many_objects_is_refused_before_decoding(tmp_path: Path) -> None:
    # Within the size and entry caps (one entry, 40 MB), but ~17x its size in memory once decoded.
    bomb = ",".join(f'"k{i}":0' for i in range(safetensors_header.MAX_HEADER_TOKENS + 1))
    raw = ('{"x":{' + bomb + '}}').encode()
    with pytest.raises(UnsafeSafetensorsError, match="JSON values, more than the .* Ferry decodes"):
        validate_safetensors(write(tmp_path, struct.pack("<Q", len(raw)) + raw))


def test_an_entry_with_keys_the_format_does_not_have_is_refused(tmp_path: Path) -> None:
    raw = b'{"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":[1,2,3]}}'
    with pytest.raises(UnsafeSafetensorsError, match=r"tensor 't': unknown keys \['extra'\]"):
        validate_safetensors(write(tmp_path, struct.pack("<Q", len(raw)) + raw + b"\0"))


def test_the_entry_cap_counts_tensors_and_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safetensors_header, "MAX_HEADER_ENTRIES", 3)
    assert len(validate_safetensors(write(tmp_path, one_byte_tensors(3))).tensors) == 3
    with pytest.raises(UnsafeSafetensorsError, match="more than 3 entries"):
        validate_safetensors(write(tmp_path, one_byte_tensors(4)))
    two_tensors = {f"t{i}": entry("U8", [1], i, i + 1) for i in range(2)}
    with pytest.raises(UnsafeSafetensorsError, match="more than 3 entries"):
        validate_safetensors(write(tmp_path, raw_safetensors(two_tensors, b"\0\0", metadata={"a": "1", "b": "2"})))


def test_the_size_cap_is_checked_from_the_length_prefix_alone(tmp_path: Path) -> None:
    # The prefix claims a header one byte past the cap and the file is that long:
    # refused on the prefix, whatever the bytes behind it are.
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER_BYTES + 1))
        f.truncate(8 + MAX_HEADER_BYTES + 1)  # sparse: no 100 MB written
    claimed = MAX_HEADER_BYTES + 1
    with pytest.raises(UnsafeSafetensorsError, match=f"header length {claimed} exceeds {MAX_HEADER_BYTES}"):
        validate_safetensors(path)


def test_a_duplicate_name_after_many_entries_is_refused(tmp_path: Path) -> None:
    data = one_byte_tensors(50_000, tail=', "t49999": {"dtype":"U8","shape":[1],"data_offsets":[50000,50001]}}')
    with pytest.raises(UnsafeSafetensorsError, match="duplicate key 't49999'"):
        validate_safetensors(write(tmp_path, data + b"\0"))


def test_a_duplicate_key_inside_an_entry_is_refused(tmp_path: Path) -> None:
    body = b'{"a": {"dtype": "U8", "dtype": "F32", "shape": [1], "data_offsets": [0, 1]}}'
    with pytest.raises(UnsafeSafetensorsError, match="duplicate key 'dtype'"):
        validate_safetensors(write(tmp_path, struct.pack("<Q", len(body)) + body + b"\0"))


@pytest.mark.parametrize("value, problem", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ("1" * 5000, "UTF-8 JSON"),  # an integer past Python's digit limit
], ids=["deep-nesting", "huge-integer"])
def test_values_that_would_raise_past_the_check_are_refused(tmp_path: Path, value: str, problem: str) -> None:
    body = ('{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1], "x": ' + value + "}}").encode()
    with pytest.raises(UnsafeSafetensorsError, match=problem):
        validate_safetensors(write(tmp_path, struct.pack("<Q", len(body)) + body + b"\0"))


def test_shapes_past_the_rank_cap_are_refused(tmp_path: Path) -> None:
    rank = MAX_TENSOR_RANK + 1
    with pytest.raises(UnsafeSafetensorsError, match=f"shape has {rank} dimensions"):
        validate_safetensors(write(tmp_path, raw_safetensors({"a": entry("U8", [1] * rank, 0, 1)}, b"\0")))
    validate_safetensors(write(tmp_path, raw_safetensors({"a": entry("U8", [1] * MAX_TENSOR_RANK, 0, 1)}, b"\0")))


@pytest.mark.parametrize("body, problem", [
    (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}} x', "extra data"),
    (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]} "b": 1}', "expected ','"),
    (b'{"a" {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', "expected ':'"),
    (b'{a: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}', "expected a string key"),
    (b'{"a": }', "UTF-8 JSON"),
    (b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},', "UTF-8 JSON"),
], ids=["trailing", "no-comma", "no-colon", "bare-key", "no-value", "unterminated"])
def test_malformed_json_read_entry_by_entry(tmp_path: Path, body: bytes, problem: str) -> None:
    with pytest.raises(UnsafeSafetensorsError, match=problem):
        validate_safetensors(write(tmp_path, struct.pack("<Q", len(body)) + body + b"\0"))


def test_whitespace_the_format_allows_is_accepted(tmp_path: Path) -> None:
    body = b'{ \n"a" :\t{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]} ,\r\n "__metadata__" : { } }   '
    header = validate_safetensors(write(tmp_path, struct.pack("<Q", len(body)) + body + b"\0"))
    assert [t.name for t in header.tensors] == ["a"] and header.metadata == {}
