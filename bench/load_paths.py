"""The in-process read paths of bench/load_bench.py, and the child process that
times one of them.

- `vllm_default`: vLLM's DefaultModelLoader on one tensor-parallel rank: every
  safetensors file of the original checkpoint, every tensor materialised, then
  narrowed to the rank's slice and copied (the parameter's `weight_loader`:
  `param.copy_(loaded_weight.narrow(dim, start, size))`);
- `vllm_default_lazy` (opt-in): the same, without materialising first: with
  safetensors >= 0.4 `get_tensor` returns a view of a private mmap, so only
  the pages the narrowed copy touches (plus the kernel's readahead) are read;
- `sharded_plain`: vLLM's ShardedStateLoader: safe_open each of the rank's
  files, get every tensor, copy it (`param.copy_(tensor)`);
- `runai`: the Run:ai streamer (runai-model-streamer's SafetensorsStreamer) on
  the same rank files, as vLLM's `runai_streamer_sharded` format does.

Each returns the rank's tensors (kept alive, as the model's parameters are).
The layout rules (`rank_slice`, `vllm_params`) are written from vLLM's layer
code (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear,
VocabParallelEmbedding), not from Ferry's shard tables, so `check` compares
two independent derivations of each rank's tensors.

Child protocol (used by load_bench.py): `python load_paths.py JSON` imports
everything, prints `ready`, waits for a line on stdin (the parent drops or
warms the page cache meanwhile), runs the case, prints one JSON line:
seconds, bytes of tensor data returned, bytes the process read from storage
(/proc/self/io read_bytes), peak RSS.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
ATTENTION_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")  # sharded_state only (vLLM >= 0.14)


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int

    @classmethod
    def from_config(cls, config: dict) -> "Dims":
        heads = config["num_attention_heads"]
        return cls(config["hidden_size"], heads, config.get("num_key_value_heads") or heads,
                   config.get("head_dim") or config["hidden_size"] // heads, config["intermediate_size"],
                   config["vocab_size"], config["num_hidden_layers"])


def rank_slice(name: str, tensor, dims: Dims, tp: int, rank: int):
    """The rank's part of a Hugging Face Llama tensor, as vLLM's weight_loader
    narrows it (a view; None for a tensor every rank holds whole)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        # VocabParallelEmbedding / ParallelLMHead: the vocabulary padded to 64, split evenly
        # along dim 0; the last ranks' rows past the vocabulary are zeros (not in the checkpoint).
        per_rank = -(-dims.vocab // VOCAB_PADDING) * VOCAB_PADDING // tp
        start = min(rank * per_rank, dims.vocab)
        return tensor.narrow(0, start, min(per_rank, dims.vocab - start))
    if name.endswith(("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")):
        # ColumnParallelLinear (q of QKVParallelLinear, gate/up of MergedColumnParallelLinear): dim 0.
        per_rank = tensor.shape[0] // tp
        return tensor.narrow(0, rank * per_rank, per_rank)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        # QKVParallelLinear: KV heads split along dim 0; with TP above the KV head count each
        # head is replicated on tp // kv_heads ranks.
        replicas = max(1, tp // dims.kv_heads)
        rows = max(1, dims.kv_heads // tp) * dims.head_dim
        return tensor.narrow(0, (rank // replicas) * rows, rows)
    if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        # RowParallelLinear: input features, dim 1.
        per_rank = tensor.shape[1] // tp
        return tensor.narrow(1, rank * per_rank, per_rank)
    if name.endswith("norm.weight"):
        return None  # RMSNorm: replicated
    raise ValueError(f"{name}: no vLLM layout rule for this tensor in the benchmark's Llama model")


def _copy(view):
    """`param.copy_(view)` into a fresh parameter: one contiguous copy."""
    import torch

    return view.clone(memory_format=torch.contiguous_format)


def vllm_default(files: list[str], config: dict, tp: int, rank: int, lazy: bool = False) -> dict:
    from safetensors import safe_open

    dims = Dims.from_config(config)
    out = {}
    for path in files:  # DefaultModelLoader: safetensors_weights_iterator, file by file
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if not lazy:
                    tensor = _copy(tensor)  # materialised: every byte of the tensor read
                view = rank_slice(name, tensor, dims, tp, rank)
                out[name] = _copy(tensor if view is None else view)
                del tensor, view
    return out


def sharded_plain(files: list[str]) -> dict:
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                out[name] = _copy(f.get_tensor(name))
    return out


def runai(files: list[str]) -> dict:
    from runai_model_streamer import SafetensorsStreamer

    out = {}
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files, device="cpu")
        for name, tensor in streamer.get_tensors():  # owned tensors: valid for as long as they are held
            out[name] = tensor
    return out


def run_case(case: str, files: list[str], config: dict, tp: int, rank: int) -> dict:
    if case == "c":
        return vllm_default(files, config, tp, rank)
    if case == "c_lazy":
        return vllm_default(files, config, tp, rank, lazy=True)
    if case == "d":
        return sharded_plain(files)
    if case == "e":
        return runai(files)
    raise ValueError(case)


def vllm_params(hf: dict, dims: Dims, tp: int) -> dict:
    """vLLM's per-rank state_dict from the rank's narrowed Hugging Face tensors:
    q|k|v fused into qkv_proj and gate|up into gate_up_proj (concatenated
    along dim 0, each loaded into its shard of the fused parameter), the
    vocabulary rows padded with zeros."""
    import torch

    per_rank = -(-dims.vocab // VOCAB_PADDING) * VOCAB_PADDING // tp
    params = {}
    for name, t in hf.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            if t.shape[0] < per_rank:
                t = torch.cat([t, t.new_zeros((per_rank - t.shape[0], *t.shape[1:]))])
            params[name] = t
        elif name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
            continue
        else:
            params[name] = t
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        params[p + "self_attn.qkv_proj.weight"] = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        params[p + "mlp.gate_up_proj.weight"] = torch.cat([hf[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])
    return params


def same_bytes(a, b) -> bool:
    import torch

    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def check(checkpoint_files: list[str], rank_files: list[str], config: dict, tp: int, rank: int) -> dict:
    """(c) against (d), and (e) against (d), for one rank; raises AssertionError."""
    dims = Dims.from_config(config)
    expected = vllm_params(vllm_default(checkpoint_files, config, tp, rank), dims, tp)
    sharded = sharded_plain(rank_files)
    scales = {n for n in sharded if n.rsplit(".", 1)[-1] in ATTENTION_SCALES}
    names = set(sharded) - scales
    assert names == set(expected), (
        f"rank {rank}: names differ: only in sharded_state {sorted(names - set(expected))[:5]}, "
        f"only in vLLM's default path {sorted(set(expected) - names)[:5]}")
    shapes = [f"{n}: (c) {list(expected[n].shape)} vs (d) {list(sharded[n].shape)}"
              for n in sorted(names) if expected[n].shape != sharded[n].shape]
    assert not shapes, f"rank {rank}: shapes differ: " + "; ".join(shapes[:5])
    differ = [n for n in sorted(names) if not same_bytes(expected[n], sharded[n])]
    assert not differ, f"rank {rank}: bytes differ: {differ[:5]}"
    streamed = runai(rank_files)
    assert set(streamed) == set(sharded), f"rank {rank}: the streamer yielded other names than safe_open"
    differ = [n for n in sorted(sharded) if not same_bytes(streamed[n], sharded[n])]
    assert not differ, f"rank {rank}: the streamer's bytes differ from safe_open's: {differ[:5]}"
    return {"rank": rank, "tensorsCompared": len(names), "attentionScalesSkipped": len(scales),
            "bytesCompared": sum(t.numel() * t.element_size() for n, t in sharded.items() if n in names)}


def _read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def child(spec: dict) -> dict:
    import safetensors  # noqa: F401  imported before the clock starts, as in a running vLLM
    import torch  # noqa: F401

    warm = spec["warmup"]  # the same code on a tiny model, before the parent drops the page cache
    run_case(spec["case"], warm["files"], warm["config"], spec["tp"], spec["rank"])
    print("ready", flush=True)
    sys.stdin.readline()
    read0, start = _read_bytes(), time.perf_counter()
    tensors = run_case(spec["case"], spec["files"], spec["config"], spec["tp"], spec["rank"])
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "readBytes": _read_bytes() - read0, "tensors": len(tensors),
            "tensorBytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "peakRssBytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))), flush=True)
