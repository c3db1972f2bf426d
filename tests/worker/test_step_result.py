"""The step result a finished step reports (results.step_result): the manifest's
digest and size, and the MoE facts of its extra that the operator records."""
from __future__ import annotations

import json

from ferry_worker.manifest import FileEntry, Manifest, manifest_digest, write_manifest
from ferry_worker.results import step_result

SHA = "0" * 64


def written(tmp_path, extra: dict) -> dict:
    write_manifest(tmp_path, Manifest(files=[FileEntry("model-pp-0-tp-0.safetensors", 7, SHA)],
                                      format="sharded_state", extra=extra))
    return step_result(tmp_path)


def test_a_moe_artifact_reports_how_its_experts_were_cut(tmp_path):
    result = written(tmp_path, {"tensorParallelSize": 4, "experts": 128, "expertParallel": True,
                                "expertPlacement": "linear", "target": "hopper", "rankFiles": {"pp0-tp0": ["x"]}})
    assert result == {"manifestDigest": manifest_digest(tmp_path), "totalBytes": 7, "files": 1,
                      "experts": 128, "expertParallel": True, "target": "hopper"}
    # A termination message: the kubelet keeps 4 KiB.
    assert len(json.dumps(result)) < 4000


def test_a_dense_artifact_reports_no_moe_facts(tmp_path):
    assert set(written(tmp_path, {"tensorParallelSize": 4})) == {"manifestDigest", "totalBytes", "files"}
