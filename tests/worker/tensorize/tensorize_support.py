"""Helpers for the tensorize tests: checkpoints big enough for multipart
uploads, reading tensorizer files back through tensorizer's own stream_io and
TensorDeserializer, and sharded_state rank files as raw tensors."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from checkpoints import LLAMA3, QWEN2, ModelCase, read_safetensors

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20

# Llama 3-shaped, ~35 MB in bf16 over two files: a TP 2 rank file spans several 5 MiB parts.
LLAMA_MID = ModelCase("llama-mid", {**LLAMA3.config, "hidden_size": 512, "intermediate_size": 1536,
                                    "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 3,
                                    "vocab_size": 8000}, "BF16", files=2,
                      extra_tensors=("model.layers.0.self_attn.rotary_emb.inv_freq",))
# Tied embeddings and q/k/v biases, fp16, tiny.
QWEN2_TIED = ModelCase("qwen2-tied", {**QWEN2.config, "num_attention_heads": 4, "num_key_value_heads": 2,
                                      "num_hidden_layers": 2, "torch_dtype": "float16"}, "F16")

Raw = dict[str, tuple[str, list[int], bytes]]  # name -> (dtype, shape, raw bytes)
TORCH_TO_ST = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32", "torch.int64": "I64"}


def run_ferry(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferry_worker.cli", *args], env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def stream_args(s3_server) -> dict[str, Any]:
    """What tensorizer's open_stream needs for the test server (force_http: it refuses http:// otherwise)."""
    from s3server import ACCESS_KEY, SECRET_KEY

    return {"s3_access_key_id": ACCESS_KEY, "s3_secret_access_key": SECRET_KEY, "s3_endpoint": s3_server.endpoint,
            "force_http": True}


def deserialize(uri: str, s3_server=None, *, key: bytes | None = None, **kwargs) -> Raw:
    """Every tensor of a tensorizer file, read by tensorizer itself (from S3 through stream_io), hashes verified."""
    from tensorizer import DecryptionParams, TensorDeserializer
    from tensorizer.stream_io import open_stream

    opened = open_stream(uri, "rb", **(stream_args(s3_server) if uri.startswith("s3://") else {}))
    encryption = DecryptionParams.from_key(key) if key is not None else None
    with opened as stream, TensorDeserializer(stream, device="cpu", verify_hash=True, encryption=encryption,
                                              **kwargs) as tensors:
        return {name: raw(tensor) for name, tensor in tensors.items()}


def raw(tensor) -> tuple[str, list[int], bytes]:
    import torch

    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return TORCH_TO_ST.get(str(tensor.dtype), str(tensor.dtype)), list(tensor.shape), data


def checkpoint_tensors(directory: Path) -> Raw:
    tensors: Raw = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= read_safetensors(path)
    return tensors


def sharded_rank(directory: Path, rank: int) -> Raw:
    tensors: Raw = {}
    for path in sorted(directory.glob(f"model-rank-{rank}-part-*.safetensors")):
        tensors |= read_safetensors(path)
    return tensors


def list_keys(client, bucket: str, prefix: str) -> list[str]:
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys += [o["Key"][len(prefix) + 1:] for o in page.get("Contents", [])]
    return sorted(keys)


def object_sha256(client, bucket: str, key: str) -> str:
    return hashlib.sha256(client.get_object(Bucket=bucket, Key=key)["Body"].read()).hexdigest()


def read_manifest_object(client, bucket: str, prefix: str) -> dict:
    return json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/ferry-manifest.json")["Body"].read())
