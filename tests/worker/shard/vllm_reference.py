"""An independent reference for vLLM's per-rank state_dict, in numpy.

Written from vLLM 0.32's loading code (QKVParallelLinear / MergedColumnParallelLinear
/ RowParallelLinear / VocabParallelEmbedding weight_loader, LlamaModel /
Qwen2Model PP placement, get_pp_indices, _filter_subtensors), not from Ferry's
layout tables: it slices whole tensors held in memory, the way vLLM does, so it
checks Ferry's streamed byte ranges against a second derivation.
Tensors are numpy arrays of raw elements (uint16 for BF16/F16): slicing does
not care what the bits mean.
"""
from __future__ import annotations

import numpy as np

RAW = {"BF16": np.uint16, "F16": np.uint16, "F32": np.uint32}


def as_arrays(weights: dict[str, tuple[str, list[int], bytes]]) -> dict[str, tuple[str, np.ndarray]]:
    return {name: (dtype, np.frombuffer(raw, dtype=RAW[dtype]).reshape(shape))
            for name, (dtype, shape, raw) in weights.items()}


def pp_indices(layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    partitions = [layers // pp_size] * pp_size
    for i in range(2, layers % pp_size + 2):
        partitions[-i] += 1
    start = sum(partitions[:pp_rank])
    return start, start + partitions[pp_rank]


def rank_state_dict(config: dict, tensors: dict[str, tuple[str, np.ndarray]], *, tp: int, tp_rank: int,
                    pp: int, pp_rank: int, scale_buffers: bool) -> dict[str, tuple[str, np.ndarray]]:
    arch = config["architectures"][0]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = (config.get("head_dim") if arch != "Qwen2ForCausalLM" else None) or hidden // heads
    vocab, tied = config["vocab_size"], config.get("tie_word_embeddings", False)
    first, last = pp_rank == 0, pp_rank == pp - 1

    # QKVParallelLinear.__init__ / weight_loader
    num_heads = heads // tp
    if tp >= kv_heads:
        num_kv, replicas = 1, tp // kv_heads
    else:
        num_kv, replicas = kv_heads // tp, 1

    def qkv(suffix: str, layer: str) -> tuple[str, np.ndarray]:
        q_dtype, q = tensors[f"{layer}self_attn.q_proj.{suffix}"]
        _, k = tensors[f"{layer}self_attn.k_proj.{suffix}"]
        _, v = tensors[f"{layer}self_attn.v_proj.{suffix}"]
        q_size, kv_size = num_heads * head_dim, num_kv * head_dim
        kv_rank = tp_rank // replicas
        return q_dtype, np.concatenate([q[tp_rank * q_size:(tp_rank + 1) * q_size],
                                        k[kv_rank * kv_size:(kv_rank + 1) * kv_size],
                                        v[kv_rank * kv_size:(kv_rank + 1) * kv_size]])

    def column(name: str) -> np.ndarray:  # output dim 0
        _, w = tensors[name]
        size = w.shape[0] // tp
        return w[tp_rank * size:(tp_rank + 1) * size]

    def row(name: str) -> tuple[str, np.ndarray]:  # input dim 1
        dtype, w = tensors[name]
        size = w.shape[1] // tp
        return dtype, np.ascontiguousarray(w[:, tp_rank * size:(tp_rank + 1) * size])

    def vocab_shard(name: str) -> tuple[str, np.ndarray]:
        dtype, w = tensors[name]
        padded = -(-vocab // 64) * 64
        per_rank = padded // tp
        start = min(tp_rank * per_rank, vocab)
        stop = min((tp_rank + 1) * per_rank, vocab)
        out = np.zeros((per_rank, w.shape[1]), dtype=w.dtype)
        out[:stop - start] = w[start:stop]
        return dtype, out

    state: dict[str, tuple[str, np.ndarray]] = {}
    if first or (tied and last):
        state["model.embed_tokens.weight"] = vocab_shard("model.embed_tokens.weight")
    for i in range(*pp_indices(config["num_hidden_layers"], pp_rank, pp)):
        p = f"model.layers.{i}."
        state[p + "self_attn.qkv_proj.weight"] = qkv("weight", p)
        if p + "self_attn.q_proj.bias" in tensors:
            state[p + "self_attn.qkv_proj.bias"] = qkv("bias", p)
        state[p + "self_attn.o_proj.weight"] = row(p + "self_attn.o_proj.weight")
        if p + "self_attn.o_proj.bias" in tensors:  # RowParallelLinear: the bias is not split
            state[p + "self_attn.o_proj.bias"] = tensors[p + "self_attn.o_proj.bias"]
        if arch == "Qwen3ForCausalLM":
            for norm in ("q_norm", "k_norm"):
                state[f"{p}self_attn.{norm}.weight"] = tensors[f"{p}self_attn.{norm}.weight"]
        if scale_buffers:
            for buffer in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
                state[f"{p}self_attn.attn.{buffer}"] = ("F32", np.array(1.0, dtype=np.float32).view(np.uint32))
        gate_dtype, _ = tensors[p + "mlp.gate_proj.weight"]
        state[p + "mlp.gate_up_proj.weight"] = (gate_dtype, np.concatenate(
            [column(p + "mlp.gate_proj.weight"), column(p + "mlp.up_proj.weight")]))
        if p + "mlp.gate_proj.bias" in tensors:
            state[p + "mlp.gate_up_proj.bias"] = (gate_dtype, np.concatenate(
                [column(p + "mlp.gate_proj.bias"), column(p + "mlp.up_proj.bias")]))
        state[p + "mlp.down_proj.weight"] = row(p + "mlp.down_proj.weight")
        if p + "mlp.down_proj.bias" in tensors:
            state[p + "mlp.down_proj.bias"] = tensors[p + "mlp.down_proj.bias"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{p}{norm}.weight"] = tensors[f"{p}{norm}.weight"]
    if last:
        state["model.norm.weight"] = tensors["model.norm.weight"]
        state["lm_head.weight"] = vocab_shard("model.embed_tokens.weight" if tied else "lm_head.weight")
        if tied:  # one storage: _filter_subtensors keeps the smaller key
            state.pop("model.embed_tokens.weight", None)
    return state
