"""What the local executor learns of a finished artifact: the same strictly
checked facts a Job's termination message carries (MoE facts included)."""
from __future__ import annotations

import json

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.executors.local import LocalExecutor
from ferry_operator.steps import Step, prepare_steps
from spec_cases import VALID

DIGEST = "sha256:" + "cd" * 32


def named(obj):
    return parse({**obj, "metadata": {"name": "qwen3-moe", "namespace": "ns", "uid": "u-1"}})


def write_manifest(ex: LocalExecutor, mw, extra) -> Step:
    last = prepare_steps(mw.spec)[-1]
    directory = ex._paths("ns", "qwen3-moe", last.digest)["artifact"]
    directory.mkdir(parents=True)
    (directory / "ferry-manifest.json").write_text(json.dumps({"totalBytes": 12, "extra": extra, "files": []}))
    return last


def test_a_claim_artifacts_moe_facts_come_from_its_manifest(tmp_path):
    ex, mw = LocalExecutor(tmp_path, "ferry"), named(VALID["moe-expert-parallel"])
    last = write_manifest(ex, mw, {"tensorParallelSize": 8, "experts": 128, "expertParallel": True,
                                   "expertPlacement": "round_robin", "target": "ampere"})
    facts = ex.artifact(mw, last)
    assert (facts.total_bytes, facts.experts, facts.expert_parallel, facts.target) == (12, 128, True, "ampere")


def test_a_dense_manifest_has_no_moe_facts_and_a_malformed_one_no_artifact(tmp_path):
    ex, mw = LocalExecutor(tmp_path, "ferry"), named(VALID["sharded-state-tp4"])
    last = write_manifest(ex, mw, {"tensorParallelSize": 4})
    assert ex.artifact(mw, last).experts is None
    manifest = ex._paths("ns", "qwen3-moe", last.digest)["artifact"] / "ferry-manifest.json"
    manifest.write_text(json.dumps({"totalBytes": 12, "extra": {"experts": "many"}, "files": []}))
    assert ex.artifact(mw, last) is None


@pytest.mark.parametrize("result,experts", [
    ({"manifestDigest": DIGEST, "totalBytes": 5, "experts": 64, "expertParallel": False, "target": "hopper"}, 64),
    ({"manifestDigest": DIGEST, "totalBytes": 5}, None),
])
def test_an_s3_artifacts_facts_come_from_the_workers_result(tmp_path, result, experts):
    ex, mw = LocalExecutor(tmp_path, "ferry"), named(VALID["tensorizer-expert-parallel"])
    last = prepare_steps(mw.spec)[-1]
    state = ex._state("ns", "qwen3-moe", last.id)
    state.mkdir(parents=True)
    (state / "result.json").write_text(json.dumps(result))
    facts = ex.artifact(mw, last)
    assert facts.uri.startswith("s3://ferry-artifacts/qwen3-moe/ns/qwen3-moe/") and facts.experts == experts
    (state / "result.json").write_text(json.dumps({**result, "expertParallel": "yes"}))
    assert ex.artifact(mw, last) is None
    (state / "result.json").write_text("tensorize failed: boom")
    assert ex.artifact(mw, last) is None
