"""The step result a worker leaves for its executor ($FERRY_RESULT_FILE, a Job's
termination log): the manifest digest and size on success, the error on failure."""
from __future__ import annotations

import hashlib
import json

from safetensors.numpy import save_file
import numpy as np

from ferry_worker.cli import main


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
    assert main(["fetch", "--source", f"file://{tmp_path}/missing", "--output", str(tmp_path / "out")]) == 1
    assert result.read_text().startswith("fetch failed: ")
