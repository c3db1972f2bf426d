"""`ferry tensorize` into the real S3-compatible server process (gofakes3 on
loopback), read back by tensorizer's own stream_io + TensorDeserializer."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from ferry_worker.cli import main
from ferry_worker.results import EXIT_INPUT
from ferry_worker.shard.job import ShardJob
from checkpoints import write_checkpoint
from tensorize_support import (LLAMA_MID, MiB, QWEN2_TIED, checkpoint_tensors, deserialize, list_keys,
                               object_sha256, read_manifest_object, run_ferry, sharded_rank)

pytestmark = pytest.mark.tensorize

COMPANIONS = ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
              "tokenizer_config.json"]
MARKER = ".vllm_tensorized_marker"


@pytest.fixture(scope="module")
def llama_mid(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "llama-mid"
    write_checkpoint(directory, LLAMA_MID, seed=3)
    return directory


@pytest.fixture(scope="module")
def qwen2_tied(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "qwen2-tied"
    write_checkpoint(directory, QWEN2_TIED, seed=4)
    return directory


def _check_manifest(s3_server, bucket: str, prefix: str, tensor_files: list[str]) -> dict:
    """The manifest lists exactly what is under the prefix, with the sha256 of each stored object."""
    client = s3_server.client()
    manifest = read_manifest_object(client, bucket, prefix)
    listed = {f["path"]: f for f in manifest["files"]}
    assert sorted(listed) == sorted(tensor_files + COMPANIONS)
    assert list_keys(client, bucket, prefix) == sorted([*listed, "ferry-manifest.json"])  # no pending record left
    for path, entry in listed.items():
        head = client.head_object(Bucket=bucket, Key=f"{prefix}/{path}")
        assert head["ContentLength"] == entry["size"], path
        assert object_sha256(client, bucket, f"{prefix}/{path}") == entry["sha256"], path
        assert manifest["extra"]["etags"][path] == head["ETag"].strip('"'), path
    assert manifest["format"] == "tensorizer"
    assert manifest["extra"]["tensorFiles"] == tensor_files
    return manifest


def test_hf_layout_reads_back_bit_exact_through_tensorizer(s3_server, s3_env, bucket, llama_mid, tmp_path):
    result = tmp_path / "result"
    proc = run_ferry("tensorize", "--source", str(llama_mid), "--output", f"s3://{bucket}/llama/hf",
                     "--part-size", "5Mi", env={**s3_env, "FERRY_RESULT_FILE": str(result)})
    assert proc.returncode == 0, proc.stderr
    manifest = _check_manifest(s3_server, bucket, "llama/hf", ["model.tensors"])
    assert manifest["extra"]["tensorizerUri"] == "model.tensors" and manifest["extra"]["layout"] == "hf"
    # Several parts, and the first (with tensorizer's prologue) uploaded last, still one coherent file.
    assert manifest["files"][[f["path"] for f in manifest["files"]].index("model.tensors")]["size"] > 6 * 5 * MiB
    stored = deserialize(f"s3://{bucket}/llama/hf/model.tensors", s3_server)
    assert stored == checkpoint_tensors(llama_mid)  # every tensor: name, dtype, shape, bytes
    body = json.loads(result.read_text())
    digest = "sha256:" + hashlib.sha256(s3_server.client().get_object(
        Bucket=bucket, Key="llama/hf/ferry-manifest.json")["Body"].read()).hexdigest()
    assert body == {"manifestDigest": digest, "totalBytes": manifest["totalBytes"], "files": 6,
                    "uri": f"s3://{bucket}/llama/hf", "tensorizerUri": f"s3://{bucket}/llama/hf/model.tensors",
                    "layout": "hf", "tensorParallelSize": 1}
    assert proc.stdout.strip() == digest


@pytest.mark.parametrize("case", ["llama_mid", "qwen2_tied"])
def test_vllm_layout_ranks_equal_ferry_shard_rank_files(s3_server, s3_env, bucket, case, request, tmp_path):
    source = request.getfixturevalue(case)
    assert main(["tensorize", "--source", str(source), "--output", f"s3://{bucket}/{case}/vllm", "--layout", "vllm",
                 "--tensor-parallel-size", "2", "--part-size", "5Mi"]) == 0
    files = ["model-rank-000.tensors", "model-rank-001.tensors"]
    manifest = _check_manifest(s3_server, bucket, f"{case}/vllm", files)
    assert manifest["extra"]["tensorizerUri"] == "model-rank-%03d.tensors"
    sharded = tmp_path / "sharded"
    ShardJob.prepare(source, sharded, tp=2, vllm_version="0.32.0").run()
    tied = json.loads((source / "config.json").read_text()).get("tie_word_embeddings", False)
    for rank, name in enumerate(files):
        stored = deserialize(f"s3://{bucket}/{case}/vllm/{name}", s3_server)
        reference = sharded_rank(sharded, rank)
        assert stored.pop(MARKER) == ("I64", [1], bytes(8))  # vLLM's marker: a meta tensor, read back as zeros
        if tied:  # sharded_state keeps one key per storage; vLLM's module tree has both modules
            assert stored["model.embed_tokens.weight"] == stored["lm_head.weight"]
            stored.pop("model.embed_tokens.weight")
        assert sorted(stored) == sorted(reference), rank
        for key, value in reference.items():
            assert stored[key] == value, f"rank {rank}: {key}"
        assert any(k.endswith("attn._k_scale") for k in stored)  # vLLM >= 0.14's persistent buffers


def test_local_output_holds_the_same_files(s3_server, s3_env, bucket, qwen2_tied, tmp_path):
    out = tmp_path / "local"
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", str(out), "--layout", "vllm", "-tp", "2"]) == 0
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", f"s3://{bucket}/q", "--layout", "vllm",
                 "-tp", "2"]) == 0
    local = json.loads((out / "ferry-manifest.json").read_text())
    remote = read_manifest_object(s3_server.client(), bucket, "q")
    # Same bytes whatever the store (tensorizer's output is deterministic without encryption).
    assert {f["path"]: f["sha256"] for f in local["files"]} == {f["path"]: f["sha256"] for f in remote["files"]}
    assert main(["verify", str(out)]) == 0
    assert main(["verify", f"s3://{bucket}/q"]) == 0


def test_encrypted_artifact_reads_back_only_with_its_key(s3_server, s3_env, bucket, qwen2_tied, tmp_path, caplog):
    from tensorizer.serialization import CryptographyError

    key = os.urandom(32)
    key_file = tmp_path / "key"
    key_file.write_bytes(key)
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", f"s3://{bucket}/enc", "--layout", "vllm",
                 "-tp", "2", "--encryption-key-file", str(key_file)]) == 0
    assert key.hex() not in caplog.text and repr(key) not in caplog.text
    manifest = read_manifest_object(s3_server.client(), bucket, "enc")
    assert manifest["extra"]["encrypted"] is True
    assert key.hex() not in json.dumps(manifest)
    sharded = tmp_path / "sharded"
    ShardJob.prepare(qwen2_tied, sharded, tp=2).run()
    stored = deserialize(f"s3://{bucket}/enc/model-rank-001.tensors", s3_server, key=key)
    assert stored["model.layers.1.mlp.down_proj.weight"] == sharded_rank(sharded, 1)["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(CryptographyError):
        deserialize(f"s3://{bucket}/enc/model-rank-001.tensors", s3_server)
    with pytest.raises(CryptographyError):
        deserialize(f"s3://{bucket}/enc/model-rank-001.tensors", s3_server, key=os.urandom(32))
    # The encrypted bytes carry no plaintext tensor.
    plain = sharded_rank(sharded, 1)["model.layers.1.mlp.down_proj.weight"][2]
    blob = s3_server.client().get_object(Bucket=bucket, Key="enc/model-rank-001.tensors")["Body"].read()
    assert plain[:256] not in blob


def test_a_rerun_keeps_a_complete_artifact_and_refuses_another_request(s3_server, s3_env, bucket, qwen2_tied):
    uri = f"s3://{bucket}/again"
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", uri]) == 0
    client = s3_server.client()
    before = client.head_object(Bucket=bucket, Key="again/model.tensors")["LastModified"]
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", uri]) == 0  # a retried Job
    assert client.head_object(Bucket=bucket, Key="again/model.tensors")["LastModified"] == before
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", uri, "--layout", "vllm"]) == EXIT_INPUT
    # A damaged artifact (an object replaced behind the manifest) is written again.
    client.put_object(Bucket=bucket, Key="again/config.json", Body=b"{}")
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", uri]) == 0
    assert main(["verify", uri]) == 0


@pytest.mark.parametrize("args, message", [
    (["--layout", "hf", "-tp", "2"], "use --layout vllm for TP > 1"),
    (["--layout", "vllm", "-tp", "2", "--vllm-version", "0.31"], "verified against vLLM 0.32.x only"),
    (["--layout", "vllm", "-tp", "3"], "tensor parallel size 3 does not divide"),
    (["--vllm-version", "0.99"], "outside the releases"),
])
def test_requests_vllm_could_not_load_are_refused_before_anything_is_written(
        s3_server, s3_env, bucket, qwen2_tied, args, message, tmp_path):
    result = tmp_path / "result"
    proc = run_ferry("tensorize", "--source", str(qwen2_tied), "--output", f"s3://{bucket}/refused", *args,
                     env={**s3_env, "FERRY_RESULT_FILE": str(result)})
    assert proc.returncode == EXIT_INPUT, proc.stderr
    assert message in proc.stderr and result.read_text().startswith("tensorize failed: ")
    assert list_keys(s3_server.client(), bucket, "refused") == []


def test_bad_key_files_and_outputs_are_refused(s3_env, bucket, qwen2_tied, tmp_path, caplog):
    key_file = tmp_path / "key"
    key_file.write_bytes(b"secret-passphrase")
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", f"s3://{bucket}/k",
                 "--encryption-key-file", str(key_file)]) == EXIT_INPUT
    assert "exactly 32 raw bytes" in caplog.text and "secret-passphrase" not in caplog.text
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", f"s3://{bucket}"]) == EXIT_INPUT
    assert main(["tensorize", "--source", str(qwen2_tied), "--output", "s3://no-such-bucket-ferry/x"]) == EXIT_INPUT
