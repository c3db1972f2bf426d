"""`ferry publish` (a checkpoint directory into S3 for the Run:ai streamer, or a
`ferry shard` artifact) and `ferry delete-artifact`, against the real S3 server.
Neither needs torch or tensorizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ferry_worker.cli import main
from ferry_worker.manifest import manifest_digest
from ferry_worker.results import EXIT_FAILED
from ferry_worker.shard.job import ShardJob
from checkpoints import MIXTRAL, write_checkpoint
from ferry_worker.shard.experts import MoeTarget
from tensorize_support import LLAMA_MID, MiB, QWEN2_TIED, list_keys, object_sha256, read_manifest_object

MANIFEST = "ferry-manifest.json"


@pytest.fixture(scope="module")
def fetched(tmp_path_factory) -> Path:
    """A checkpoint as `ferry fetch` leaves it: vLLM's files plus ferry-manifest.json."""
    root = tmp_path_factory.mktemp("publish")
    write_checkpoint(root / "hub", LLAMA_MID, seed=7)
    assert main(["fetch", "--source", f"file://{root / 'hub'}", "--output", str(root / "fetched")]) == 0
    return root / "fetched"


def _objects_match_manifest(client, bucket: str, prefix: str) -> dict:
    manifest = read_manifest_object(client, bucket, prefix)
    assert list_keys(client, bucket, prefix) == sorted([f["path"] for f in manifest["files"]] + [MANIFEST])
    for entry in manifest["files"]:
        key = f"{prefix}/{entry['path']}"
        assert client.head_object(Bucket=bucket, Key=key)["ContentLength"] == entry["size"]
        assert object_sha256(client, bucket, key) == entry["sha256"], entry["path"]
    return manifest


def test_publish_a_fetched_checkpoint(s3_server, s3_env, bucket, fetched, tmp_path, monkeypatch):
    result = tmp_path / "result"
    monkeypatch.setenv("FERRY_RESULT_FILE", str(result))
    assert main(["publish", "--source", str(fetched), "--output", f"s3://{bucket}/runai/llama",
                 "--part-size", "5Mi"]) == 0
    client = s3_server.client()
    manifest = _objects_match_manifest(client, bucket, "runai/llama")
    source = json.loads((fetched / MANIFEST).read_text())
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == {f["path"]: f["sha256"] for f in source["files"]}
    assert manifest["format"] == "safetensors" and manifest["extra"]["publishedFrom"] == manifest_digest(fetched)
    assert max(f["size"] for f in manifest["files"]) > 3 * 5 * MiB  # multipart objects among them
    assert json.loads(result.read_text())["uri"] == f"s3://{bucket}/runai/llama"
    assert main(["verify", f"s3://{bucket}/runai/llama"]) == 0
    # verify names what changed behind the manifest
    client.put_object(Bucket=bucket, Key="runai/llama/config.json", Body=b"{}")
    assert main(["verify", f"s3://{bucket}/runai/llama"]) == EXIT_FAILED


def test_publish_a_sharded_state_artifact_keeps_its_facts(s3_server, s3_env, bucket, tmp_path):
    write_checkpoint(tmp_path / "ckpt", QWEN2_TIED, seed=8)
    ShardJob.prepare(tmp_path / "ckpt", tmp_path / "sharded", tp=2).run()
    assert main(["publish", "--source", str(tmp_path / "sharded"), "--output", f"s3://{bucket}/sharded"]) == 0
    manifest = _objects_match_manifest(s3_server.client(), bucket, "sharded")
    assert manifest["format"] == "sharded_state" and manifest["extra"]["tensorParallelSize"] == 2


def test_a_published_moe_cut_reports_its_expert_facts(s3_server, s3_env, bucket, tmp_path, monkeypatch):
    """runai_streamer_sharded's last step is the publish: its result must carry the cut's expert facts, which
    the operator needs to refuse data parallelism and EPLB on the serving pods."""
    write_checkpoint(tmp_path / "ckpt", MIXTRAL, seed=8)
    ShardJob.prepare(tmp_path / "ckpt", tmp_path / "sharded", tp=2, moe=MoeTarget(expert_parallel=True)).run()
    monkeypatch.setenv("FERRY_RESULT_FILE", str(tmp_path / "result"))
    assert main(["publish", "--source", str(tmp_path / "sharded"), "--output", f"s3://{bucket}/moe"]) == 0
    result = json.loads((tmp_path / "result").read_text())
    assert (result["experts"], result["expertParallel"], result["target"]) == (4, True, "hopper"), result


def test_a_plain_directory_is_validated_and_published(s3_server, s3_env, bucket, tmp_path):
    write_checkpoint(tmp_path / "plain", QWEN2_TIED, seed=9)
    (tmp_path / "plain" / ".ferry-fetch-journal.json").write_text("{}")  # Ferry's own files never travel
    assert main(["publish", "--source", str(tmp_path / "plain"), "--output", f"s3://{bucket}/plain"]) == 0
    manifest = _objects_match_manifest(s3_server.client(), bucket, "plain")
    assert ".ferry-fetch-journal.json" not in [f["path"] for f in manifest["files"]]
    (tmp_path / "plain" / "model.safetensors").write_bytes(b"\xff" * 64)
    assert main(["publish", "--source", str(tmp_path / "plain"), "--output", f"s3://{bucket}/bad"]) == 2


def test_a_source_that_disagrees_with_its_manifest_is_not_published(s3_server, s3_env, bucket, tmp_path):
    write_checkpoint(tmp_path / "hub", QWEN2_TIED, seed=10)
    assert main(["fetch", "--source", f"file://{tmp_path / 'hub'}", "--output", str(tmp_path / "fetched")]) == 0
    weights = tmp_path / "fetched" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # bit rot: same size
    weights.write_bytes(bytes(data))
    assert main(["publish", "--source", str(tmp_path / "fetched"), "--output", f"s3://{bucket}/rot"]) == EXIT_FAILED
    keys = list_keys(s3_server.client(), bucket, "rot")
    assert MANIFEST not in keys and "model.safetensors" not in keys


def test_delete_artifact_removes_exactly_what_ferry_wrote(s3_server, s3_env, bucket, fetched):
    client = s3_server.client()
    assert main(["publish", "--source", str(fetched), "--output", f"s3://{bucket}/gone/llama"]) == 0
    client.put_object(Bucket=bucket, Key="gone/llama/README-not-ferrys.md", Body=b"mine")
    client.put_object(Bucket=bucket, Key="gone/llama-2/config.json", Body=b"{}")  # a sibling prefix
    assert main(["delete-artifact", f"s3://{bucket}/gone/llama"]) == 0
    assert list_keys(client, bucket, "gone/llama") == ["README-not-ferrys.md"]
    assert list_keys(client, bucket, "gone/llama-2") == ["config.json"]
    assert main(["delete-artifact", f"s3://{bucket}/gone/llama"]) == 0  # idempotent


def test_delete_artifact_of_an_unfinished_run_uses_its_pending_record(s3_server, s3_env, bucket, tmp_path):
    client = s3_server.client()
    client.put_object(Bucket=bucket, Key="half/.ferry-pending.json",
                      Body=json.dumps({"files": ["model.tensors", "config.json"]}).encode())
    client.put_object(Bucket=bucket, Key="half/config.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="half/other.bin", Body=b"x")
    client.create_multipart_upload(Bucket=bucket, Key="half/model.tensors")
    assert main(["delete-artifact", f"s3://{bucket}/half"]) == 0
    assert list_keys(client, bucket, "half") == ["other.bin"]
    uploads = client.list_multipart_uploads(Bucket=bucket, Prefix="half/").get("Uploads") or []
    assert not [u for u in uploads if u["Key"] == "half/model.tensors"]


def test_local_delete_artifact(tmp_path):
    write_checkpoint(tmp_path / "ckpt", QWEN2_TIED, seed=11)
    assert main(["publish", "--source", str(tmp_path / "ckpt"), "--output", str(tmp_path / "copy")]) == 0
    assert main(["verify", str(tmp_path / "copy")]) == 0
    (tmp_path / "copy" / "mine.txt").write_text("keep")
    assert main(["delete-artifact", str(tmp_path / "copy")]) == 0
    assert [p.name for p in (tmp_path / "copy").iterdir()] == ["mine.txt"]
