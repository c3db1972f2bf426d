"""Small checkpoints shaped like real Hub repositories, for the fetch tests.

Weights are random but every .safetensors file is valid (the safetensors
library reads them); .bin/.pt files are opaque bytes (Ferry never unpickles).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1}


def safetensors_blob(tensors: dict[str, tuple[str, list[int]]], seed: int = 0) -> bytes:
    """A valid safetensors file with random data: {name: (dtype, shape)}."""
    rng = np.random.default_rng(seed)
    header, offset = {}, 0
    for name in sorted(tensors):
        dtype, shape = tensors[name]
        size = int(np.prod(shape, dtype=np.int64)) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    return raw_safetensors(header, rng.bytes(offset), metadata={"format": "pt"})


def raw_safetensors(header: dict, data: bytes, metadata: dict | None = None) -> bytes:
    """A safetensors file exactly as given, consistent or not (for hostile-header tests)."""
    body = dict(header)
    if metadata is not None:
        body["__metadata__"] = metadata
    encoded = json.dumps(body).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header to 8 bytes
    return struct.pack("<Q", len(encoded)) + encoded + data


def layer_shard(first: int, last: int, hidden: int = 64, seed: int = 0) -> bytes:
    tensors = {}
    for i in range(first, last + 1):
        tensors[f"model.layers.{i}.self_attn.q_proj.weight"] = ("BF16", [hidden, hidden])
        tensors[f"model.layers.{i}.mlp.down_proj.weight"] = ("BF16", [hidden, 2 * hidden])
        tensors[f"model.layers.{i}.input_layernorm.weight"] = ("BF16", [hidden])
    return safetensors_blob(tensors, seed)


def index_for(shards: dict[str, bytes]) -> bytes:
    """model.safetensors.index.json for the given shard files."""
    weight_map = {}
    for name, blob in shards.items():
        (n,) = struct.unpack("<Q", blob[:8])
        for tensor in json.loads(blob[8 : 8 + n]):
            if tensor != "__metadata__":
                weight_map[tensor] = name
    total = sum(len(b) for b in shards.values())
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()


def _common() -> dict[str, bytes]:
    return {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}).encode(),
        "generation_config.json": b'{"do_sample": false}',
        "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
        "tokenizer_config.json": b'{"model_max_length": 8192}',
        "special_tokens_map.json": b'{"bos_token": "<s>"}',
        "README.md": b"# model card\n",
        ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    }


def llama3_like() -> dict[str, bytes]:
    """meta-llama/Meta-Llama-3-8B-Instruct's shape: sharded safetensors + index, original/ checkpoint."""
    shards = {"model-00001-of-00002.safetensors": layer_shard(0, 1, seed=1),
              "model-00002-of-00002.safetensors": layer_shard(2, 3, seed=2)}
    return {
        **_common(), **shards,
        "model.safetensors.index.json": index_for(shards),
        "LICENSE": b"license text\n",
        "original/consolidated.00.pth": b"\x80\x02pickled-llama" * 64,
        "original/params.json": b'{"dim": 64}',
        "original/tokenizer.model": b"tiktoken-bpe-ranks",
    }


def mistral_v03_like() -> dict[str, bytes]:
    """mistralai/Mistral-7B-Instruct-v0.3's shape: consolidated.safetensors next to sharded files + index."""
    shards = {"model-00001-of-00002.safetensors": layer_shard(0, 1, seed=3),
              "model-00002-of-00002.safetensors": layer_shard(2, 3, seed=4)}
    return {
        **_common(), **shards,
        "model.safetensors.index.json": index_for(shards),
        "consolidated.safetensors": layer_shard(0, 3, seed=5),
        "params.json": b'{"dim": 64, "n_layers": 4}',
        "tokenizer.model": b"sentencepiece-model",
        "tokenizer.model.v3": b"sentencepiece-model-v3",
    }


def mistral_v01_like() -> dict[str, bytes]:
    """mistralai/Mistral-7B-v0.1's shape: pytorch_model-*.bin and model-*.safetensors, two indexes."""
    shards = {"model-00001-of-00002.safetensors": layer_shard(0, 1, seed=6),
              "model-00002-of-00002.safetensors": layer_shard(2, 3, seed=7)}
    return {
        **_common(), **shards,
        "model.safetensors.index.json": index_for(shards),
        "pytorch_model-00001-of-00002.bin": b"PK\x03\x04torch-zip" * 128,
        "pytorch_model-00002-of-00002.bin": b"PK\x03\x04torch-zip" * 128,
        "pytorch_model.bin.index.json": b'{"weight_map": {}}',
    }


def finetune_bin_like() -> dict[str, bytes]:
    """A Trainer output pushed as is: one .bin checkpoint plus training artifacts."""
    return {
        **_common(),
        "pytorch_model.bin": b"PK\x03\x04torch-zip" * 256,
        "training_args.bin": b"PK\x03\x04args",
        "optimizer.pt": b"PK\x03\x04optim" * 512,
        "scheduler.pt": b"PK\x03\x04sched",
        "rng_state.pth": b"PK\x03\x04rng",
        "trainer_state.json": b'{"global_step": 100}',
    }


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root
