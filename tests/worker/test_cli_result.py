"""The step result a worker leaves for its executor ($FERRY_RESULT_FILE, a Job's
termination log): the manifest digest and size on success, the error on failure."""
from __future__ import annotations

import hashlib
import json

from safetensors.numpy import save_file
import numpy as np

import pytest

from ferry_worker.cli import main
from ferry_worker.fetch.selection import NoWeightsError
from ferry_worker.paths import UnsafePathError
from ferry_worker.results import EXIT_FAILED, EXIT_INPUT, is_input_error
from ferry_worker.shard.model import ShardError
from ferry_worker.sources.base import BadSourceError, SourceError


def test_success_reports_the_manifest_digest(tmp_path, monkeypatch):
    src, out, result = tmp_path / "src", tmp_path / "out", tmp_path / "result"
    src.mkdir()
    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(src / "model.safetensors"))
    (src / "config.json").write_text("{}")
    monkeypatch.setenv("FERRY_RESULT_FILE", str(result))
    assert main(["fetch", "--source", f"file://{src}", "--output", str(out)]) == 0
    body = json.loads(result.read_text())
    manifest = (out / "ferry-manifest.json").read_bytes()
    assert body["manifestDigest"] == "sha256:" + hashlib.sha256(manifest).hexdigest()
    assert body["totalBytes"] == sum(f["size"] for f in json.loads(manifest)["files"])


def test_failure_reports_the_error_line(tmp_path, monkeypatch):
    result = tmp_path / "result"
    monkeypatch.setenv("FERRY_RESULT_FILE", str(result))
    # A source that is not there: an input error (exit 2), which a prepare Job does not retry.
    assert main(["fetch", "--source", f"file://{tmp_path}/missing", "--output", str(tmp_path / "out")]) == EXIT_INPUT
    assert result.read_text().startswith("fetch failed: ")


def test_a_failure_not_known_to_be_the_inputs_fault_exits_1(tmp_path):
    # Exit 1 lets a prepare Job retry; only errors known to be deterministic exit 2.
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": np.zeros((4, 4), dtype=np.float32)}, str(src / "model.safetensors"))
    (tmp_path / "out").write_text("a file where the output directory goes")
    assert main(["fetch", "--source", f"file://{src}", "--output", str(tmp_path / "out")]) == EXIT_FAILED


class ClientError(Exception):  # botocore's, as far as is_input_error looks
    def __init__(self, code):
        super().__init__(code)
        self.response = {"Error": {"Code": code}}


class RepositoryNotFoundError(Exception):
    pass


class GatedRepoError(RepositoryNotFoundError):
    pass


class LocalEntryNotFoundError(Exception):  # huggingface_hub raises it for network failures too
    pass


def wrapped(inner):
    try:
        raise SourceError("s3://b/m: model.safetensors: wrapped") from inner
    except SourceError as e:
        return e


@pytest.mark.parametrize("error,expected", [
    (BadSourceError("file:///x: not a directory"), True),
    (NoWeightsError("no model weights found"), True),
    (ShardError("tensor parallel size 3 does not divide"), True),
    (UnsafePathError("refusing file name"), True),
    (GatedRepoError("gated"), True),
    (ClientError("NoSuchBucket"), True),
    (wrapped(ClientError("AccessDenied")), True),
    (ClientError("SlowDown"), False),
    (wrapped(ConnectionResetError()), False),
    (SourceError("changed while it was being listed"), False),
    (LocalEntryNotFoundError("connection error"), False),
    (OSError("No space left on device"), False),
    (MemoryError(), False),
])
def test_input_errors_are_told_from_retryable_ones(error, expected):
    assert is_input_error(error) is expected
