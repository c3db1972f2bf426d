"""Small Hugging Face checkpoints, generated (no model hub is reachable): real
architectures' config.json (scaled down) and tensor names, random weights, a
real tokenizer. Used by the demos and the tests.

The tensor list here is written from the Hugging Face modelling code, not from
Ferry's layout tables, so a mistake in a table shows up as a mismatch.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

WORDS_PER_VOCAB = 3  # ids 0..2 are <unk>, <s>, </s>


Weights = dict[str, tuple[str, list[int], bytes]]  # name -> (safetensors dtype, shape, raw bytes)


@dataclass(frozen=True)
class ModelCase:
    name: str
    config: dict
    dtype: str  # safetensors dtype of every weight: BF16 or F16
    files: int = 1  # > 1: sharded with model.safetensors.index.json
    extra_tensors: tuple[str, ...] = field(default=())  # e.g. rotary inv_freq buffers


def _llama_like(arch: str, model_type: str, **overrides) -> dict:
    config = {
        "architectures": [arch], "model_type": model_type, "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 128,
        "initializer_range": 0.02, "intermediate_size": 256, "max_position_embeddings": 512,
        "num_attention_heads": 8, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.46.0", "use_cache": True, "vocab_size": 1000,
    }
    config.update(overrides)
    return config


# Meta-Llama-3-8B: GQA, untied, vocab not a multiple of 64 here (1000 -> 1024).
LLAMA3 = ModelCase("llama3", _llama_like("LlamaForCausalLM", "llama", pretraining_tp=1, rope_scaling=None), "BF16",
                   files=2, extra_tensors=("model.layers.0.self_attn.rotary_emb.inv_freq",))
# Llama-3.2-1B: tied embeddings, explicit head_dim, llama3 rope scaling.
LLAMA32_TIED = ModelCase("llama3.2-tied", _llama_like(
    "LlamaForCausalLM", "llama", head_dim=16, tie_word_embeddings=True, vocab_size=1088,
    rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                  "original_max_position_embeddings": 8192, "rope_type": "llama3"}), "BF16")
# Mistral-Nemo: head_dim (32) x heads (8) != hidden_size (128); fp16.
MISTRAL = ModelCase("mistral", _llama_like(
    "MistralForCausalLM", "mistral", head_dim=32, sliding_window=None, rope_theta=1000000.0,
    torch_dtype="float16", vocab_size=777), "F16")
# Qwen2.5-0.5B: q/k/v biases, tied embeddings.
QWEN2 = ModelCase("qwen2", _llama_like(
    "Qwen2ForCausalLM", "qwen2", max_window_layers=3, sliding_window=512, use_sliding_window=False,
    rope_theta=1000000.0, rms_norm_eps=1e-06, tie_word_embeddings=True, vocab_size=1000), "BF16")
# Qwen3-0.6B: q_norm/k_norm, explicit head_dim, tied embeddings.
QWEN3 = ModelCase("qwen3", _llama_like(
    "Qwen3ForCausalLM", "qwen3", head_dim=32, max_window_layers=3, sliding_window=None,
    use_sliding_window=False, rope_theta=1000000, rms_norm_eps=1e-06, tie_word_embeddings=True,
    vocab_size=1000), "BF16")

# Llama with every optional bias (`attention_bias`: q/k/v/o, `mlp_bias`: gate/up/down).
LLAMA_BIASES = ModelCase("llama-biases", _llama_like("LlamaForCausalLM", "llama", attention_bias=True, mlp_bias=True),
                         "BF16")

ALL_CASES = (LLAMA3, LLAMA32_TIED, MISTRAL, QWEN2, QWEN3, LLAMA_BIASES)

# The families of issue 16, scaled down from the releases named.
# Phi-3-mini-4k: fused qkv_proj and gate_up_proj, untied.
PHI3 = ModelCase("phi3", _llama_like("Phi3ForCausalLM", "phi3", num_key_value_heads=8, rope_theta=10000.0,
                                     vocab_size=1000), "BF16")
# Gemma-2-2b: four norms per layer, explicit head_dim, no lm_head (always tied).
GEMMA2 = ModelCase("gemma2", _llama_like(
    "Gemma2ForCausalLM", "gemma2", head_dim=32, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
    sliding_window=256, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rms_norm_eps=1e-06,
    tie_word_embeddings=True, vocab_size=1000), "BF16")
# Gemma-3-1b: q_norm/k_norm too, tied.
GEMMA3 = ModelCase("gemma3", _llama_like(
    "Gemma3ForCausalLM", "gemma3_text", head_dim=32, hidden_activation="gelu_pytorch_tanh",
    query_pre_attn_scalar=32, sliding_window=256, rms_norm_eps=1e-06, tie_word_embeddings=True,
    rope_local_base_freq=10000.0, vocab_size=1000), "BF16")
# Mixtral-8x7B: every layer MoE (w1/w2/w3 per expert), 4 experts, top 2.
MIXTRAL = ModelCase("mixtral", _llama_like(
    "MixtralForCausalLM", "mixtral", num_local_experts=4, num_experts_per_tok=2, rope_theta=1000000.0,
    router_aux_loss_coef=0.02, output_router_logits=False, sliding_window=None, vocab_size=1000), "BF16")
# Qwen3-30B-A3B: MoE with gate/up/down per expert, q/k norms, one dense layer (mlp_only_layers).
QWEN3_MOE = ModelCase("qwen3-moe", _llama_like(
    "Qwen3MoeForCausalLM", "qwen3_moe", head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True, rope_theta=1000000.0, rms_norm_eps=1e-06,
    tie_word_embeddings=False, vocab_size=1000), "BF16")

_MLA_CONFIG = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
                   qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=64, first_k_dense_replace=1, moe_layer_freq=1, rms_norm_eps=1e-06)
# DeepSeek-V2-Lite: MLA without a q LoRA, 2 shared experts, layer 0 dense, softmax routing.
DEEPSEEK_V2 = ModelCase("deepseek-v2", _llama_like(
    "DeepseekV2ForCausalLM", "deepseek_v2", **_MLA_CONFIG, q_lora_rank=None, n_shared_experts=2,
    topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax"), "BF16")
# DeepSeek-V3: q LoRA (fused_qkv_a_proj), 1 shared expert, grouped sigmoid routing with a float32
# e_score_correction_bias, and one multi-token-prediction layer past num_hidden_layers.
DEEPSEEK_V3 = ModelCase("deepseek-v3", _llama_like(
    "DeepseekV3ForCausalLM", "deepseek_v3", **_MLA_CONFIG, q_lora_rank=48, n_shared_experts=1,
    topk_method="noaux_tc", n_group=2, topk_group=1, scoring_func="sigmoid", routed_scaling_factor=2.5,
    num_nextn_predict_layers=1), "BF16",
    extra_tensors=("model.layers.3.enorm.weight", "model.layers.3.eh_proj.weight"))

BREADTH_CASES = (PHI3, GEMMA2, GEMMA3, MIXTRAL, QWEN3_MOE, DEEPSEEK_V2, DEEPSEEK_V3)


def hf_tensor_shapes(config: dict) -> dict[str, list[int]]:
    """The tensors transformers' modelling code saves for this config."""
    arch = config["architectures"][0]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    tied = config.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)
    shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
    if not tied and arch != "Gemma2ForCausalLM":  # Gemma 2 always ties (no lm_head module)
        shapes["lm_head.weight"] = [vocab, hidden]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        attention, mlp = _attention_shapes(config), _mlp_shapes(config, i)
        # This order (weights, norms, then biases and q/k norms) fixes the random stream, so the
        # fixtures' weights stay what the token tests were tuned on.
        layer = {k: v for k, v in (attention | mlp).items() if not _optional(k)}
        layer |= {"input_layernorm.weight": [hidden], "post_attention_layernorm.weight": [hidden]}
        if arch in GEMMA_ARCHITECTURES:
            layer |= {"pre_feedforward_layernorm.weight": [hidden], "post_feedforward_layernorm.weight": [hidden]}
        layer |= {k: v for k, v in attention.items() if k.endswith(".bias")}
        layer |= {k: v for k, v in mlp.items() if k.endswith(".bias")}
        layer |= {k: v for k, v in attention.items() if k.endswith(("q_norm.weight", "k_norm.weight"))}
        shapes |= {p + k: v for k, v in layer.items()}
    return shapes


def _optional(name: str) -> bool:
    return name.endswith((".bias", "q_norm.weight", "k_norm.weight"))


GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")


DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _mla_shapes(config: dict) -> dict[str, list[int]]:
    """DeepseekV2Attention (MLA) in transformers: q LoRA (V3) or a plain q_proj (V2-Lite)."""
    hidden, heads, q_lora = config["hidden_size"], config["num_attention_heads"], config.get("q_lora_rank")
    kv_lora, rope, nope, v = (config[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                   "v_head_dim"))
    shapes = {"self_attn.kv_a_proj_with_mqa.weight": [kv_lora + rope, hidden],
              "self_attn.kv_a_layernorm.weight": [kv_lora],
              "self_attn.kv_b_proj.weight": [heads * (nope + v), kv_lora],
              "self_attn.o_proj.weight": [hidden, heads * v]}
    if q_lora is None:
        return shapes | {"self_attn.q_proj.weight": [heads * (nope + rope), hidden]}
    return shapes | {"self_attn.q_a_proj.weight": [q_lora, hidden], "self_attn.q_a_layernorm.weight": [q_lora],
                     "self_attn.q_b_proj.weight": [heads * (nope + rope), q_lora]}


def _attention_shapes(config: dict) -> dict[str, list[int]]:
    arch = config["architectures"][0]
    if arch in DEEPSEEK_ARCHITECTURES:
        return _mla_shapes(config)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    if arch == "Phi3ForCausalLM":  # Phi3Attention: one fused qkv_proj
        return {"self_attn.qkv_proj.weight": [q + 2 * kv, hidden], "self_attn.o_proj.weight": [hidden, q]}
    shapes = {"self_attn.q_proj.weight": [q, hidden], "self_attn.k_proj.weight": [kv, hidden],
              "self_attn.v_proj.weight": [kv, hidden], "self_attn.o_proj.weight": [hidden, q]}
    if arch == "Qwen2ForCausalLM" or config.get("attention_bias", False):
        shapes |= {"self_attn.q_proj.bias": [q], "self_attn.k_proj.bias": [kv], "self_attn.v_proj.bias": [kv]}
    if arch in ("LlamaForCausalLM", "MistralForCausalLM", *GEMMA_ARCHITECTURES) and config.get("attention_bias"):
        shapes["self_attn.o_proj.bias"] = [hidden]
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"):
        shapes |= {"self_attn.q_norm.weight": [head_dim], "self_attn.k_norm.weight": [head_dim]}
    return shapes


_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")


def _experts(block: str, count: int, inter: int, hidden: int, names: tuple[str, ...]) -> dict[str, list[int]]:
    """Per-expert MLP tensors in the given name order; a name with `down` or `w2` projects back to hidden."""
    return {f"{block}.experts.{e}.{name}.weight": [hidden, inter] if name in ("down_proj", "w2") else [inter, hidden]
            for e in range(count) for name in names}


def _mlp_shapes(config: dict, layer: int) -> dict[str, list[int]]:
    arch, hidden, inter = config["architectures"][0], config["hidden_size"], config["intermediate_size"]
    if arch == "MixtralForCausalLM":  # MixtralSparseMoeBlock, saved with per-expert names
        shapes = {"block_sparse_moe.gate.weight": [config["num_local_experts"], hidden]}
        return shapes | _experts("block_sparse_moe", config["num_local_experts"], inter, hidden, ("w1", "w2", "w3"))
    if arch == "Qwen3MoeForCausalLM" and layer not in config.get("mlp_only_layers", []) \
            and (layer + 1) % config.get("decoder_sparse_step", 1) == 0:
        moe_inter = config["moe_intermediate_size"]
        shapes = {"mlp.gate.weight": [config["num_experts"], hidden]}
        return shapes | _experts("mlp", config["num_experts"], moe_inter, hidden, _GATE_UP_DOWN)
    if arch in DEEPSEEK_ARCHITECTURES and layer >= config["first_k_dense_replace"]:
        moe_inter, experts = config["moe_intermediate_size"], config["n_routed_experts"]
        shapes = {"mlp.gate.weight": [experts, hidden]}
        if config.get("topk_method") == "noaux_tc":
            shapes["mlp.gate.e_score_correction_bias"] = [experts]
        shapes |= _experts("mlp", experts, moe_inter, hidden, _GATE_UP_DOWN)
        shared = moe_inter * config["n_shared_experts"]
        return shapes | {"mlp.shared_experts.gate_proj.weight": [shared, hidden],
                         "mlp.shared_experts.up_proj.weight": [shared, hidden],
                         "mlp.shared_experts.down_proj.weight": [hidden, shared]}
    if arch == "Phi3ForCausalLM":  # Phi3MLP: one fused gate_up_proj
        return {"mlp.gate_up_proj.weight": [2 * inter, hidden], "mlp.down_proj.weight": [hidden, inter]}
    shapes = {"mlp.gate_proj.weight": [inter, hidden], "mlp.up_proj.weight": [inter, hidden],
              "mlp.down_proj.weight": [hidden, inter]}
    if config.get("mlp_bias"):
        shapes |= {"mlp.gate_proj.bias": [inter], "mlp.up_proj.bias": [inter], "mlp.down_proj.bias": [hidden]}
    return shapes


def to_dtype_bytes(values: np.ndarray, dtype: str) -> bytes:
    """float32 values as BF16 (round to nearest even), F16 or F32 little-endian bytes."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if dtype == "F32":
        return values.astype("<f4").tobytes()
    if dtype == "F16":
        return values.astype("<f2").tobytes()
    if dtype == "BF16":
        bits = values.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    raise ValueError(dtype)


def random_weights(config: dict, dtype: str, seed: int = 0) -> Weights:
    """Random weights scaled so the decoder layers, not the token's own
    embedding, decide the next token: with embeddings as large as the layers'
    output, a tied LM head just repeats the last token and greedy decoding
    would not notice a mangled layer. The final norm restores the logits'
    spread, so greedy choices are rarely near-ties."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in hf_tensor_shapes(config).items():
        if name.endswith("e_score_correction_bias"):  # float32 in DeepSeek-V3's checkpoint
            weights[name] = ("F32", shape, to_dtype_bytes(0.01 * rng.standard_normal(shape), "F32"))
            continue
        if name == "model.norm.weight":
            values = 10.0 * (1.0 + 0.1 * rng.standard_normal(shape))
        elif name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            values = 0.1 * rng.standard_normal(shape)
        else:
            values = 0.08 * rng.standard_normal(shape)
        weights[name] = (dtype, shape, to_dtype_bytes(values, dtype))
    return weights


# The router of a MoE block (`mlp.gate`, `block_sparse_moe.gate`): kept in bf16 by every FP8 release.
ROUTER = ".gate.weight"
FP8_NAN = (0x7F, 0xFF)  # float8_e4m3fn has no infinities; these two bytes are its NaNs


def fp8_block_config(config: dict, block: list[int], not_converted: tuple[str, ...] = ()) -> dict:
    """config.json of an FP8 block-scaled release (DeepSeek-V3's keys; Qwen3-*-FP8
    list the modules they keep in bf16 under modules_to_not_convert)."""
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block}
    if not_converted:
        quant["modules_to_not_convert"] = list(not_converted)
    return {**config, "quantization_config": quant}


def fp8_quantized(name: str, shape: list[int], not_converted: set[str], routers: bool) -> bool:
    """Whether an FP8 release stores this tensor in FP8: a linear weight of the
    decoder layers (routers only if `routers`) whose module is not listed."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
            and (routers or not name.endswith(ROUTER)) and name.removesuffix(".weight") not in not_converted)


def fp8_block_scaled(weights: Weights, config: dict, seed: int = 0, routers: bool = False) -> Weights:
    """The checkpoint as an FP8 block-scaled release ships it: every linear
    weight of the decoder layers (2-D `.weight` under `model.layers.`; routers
    only if `routers`) not listed in modules_to_not_convert becomes F8_E4M3
    bytes plus a float32 `weight_scale_inv` [ceil(out/bn), ceil(in/bk)].
    Embeddings, norms, the LM head and biases stay as they are. The bytes are
    random finite e4m3 values and positive scales: what is under test here is
    where bytes go, not what they mean (the vLLM tests quantize for real)."""
    quant = config["quantization_config"]
    bn, bk = quant["weight_block_size"]
    kept = set(quant.get("modules_to_not_convert") or [])
    rng = np.random.default_rng(seed + 8)
    out: Weights = {}
    for name, (dtype, shape, raw) in weights.items():
        if not fp8_quantized(name, shape, kept, routers):
            out[name] = (dtype, shape, raw)
            continue
        fp8 = rng.integers(0, 256, size=shape, dtype=np.uint8)
        fp8[np.isin(fp8, FP8_NAN)] = 0
        scale_shape = [-(-shape[0] // bn), -(-shape[1] // bk)]
        out[name] = ("F8_E4M3", shape, fp8.tobytes())
        out[name + "_scale_inv"] = ("F32", scale_shape, to_dtype_bytes(rng.uniform(1e-4, 1e-2, scale_shape), "F32"))
    return out


def pack_quantized(weights: Weights, config: dict, seed: int = 0) -> Weights:
    """The checkpoint as a compressed-tensors pack-quantized release ships it (the layout only: random
    int32 words, positive scales; tests/worker/shard/quant_checkpoint.py quantizes for real): each linear weight
    of the decoder layers not in `ignore` becomes weight_packed [out, in / pack] I32, weight_scale
    [out, in / group or 1] in the model dtype, weight_shape [out, in] I64, and weight_zero_point
    [out / pack, groups] I32 when asymmetric."""
    quant = config["quantization_config"]
    args = next(iter(quant["config_groups"].values()))["weights"]
    pack, group = 32 // int(args["num_bits"]), args.get("group_size") if args["strategy"] == "group" else None
    kept = set(quant.get("ignore") or [])
    rng = np.random.default_rng(seed + 16)
    out: Weights = {}
    for name, (dtype, shape, raw) in weights.items():
        if not fp8_quantized(name, shape, kept, routers=False):
            out[name] = (dtype, shape, raw)
            continue
        stem, (rows, cols) = name.removesuffix("weight"), shape
        groups = cols // group if group else 1
        out[stem + "weight_packed"] = ("I32", [rows, cols // pack],
                                       rng.integers(-2**31, 2**31, size=(rows, cols // pack), dtype=np.int32).tobytes())
        out[stem + "weight_scale"] = (dtype, [rows, groups], to_dtype_bytes(rng.uniform(1e-3, 1e-2, (rows, groups)),
                                                                            dtype))
        out[stem + "weight_shape"] = ("I64", [2], np.array([rows, cols], dtype="<i8").tobytes())
        if not args.get("symmetric", True):
            out[stem + "weight_zero_point"] = ("I32", [rows // pack, groups], rng.integers(
                -2**31, 2**31, size=(rows // pack, groups), dtype=np.int32).tobytes())
    return out


def fp8_tensor_scaled(weights: Weights, config: dict, seed: int = 0) -> Weights:
    """The checkpoint as a per-tensor FP8 release (AutoFP8's layout) ships it: each linear weight of the
    decoder layers F8_E4M3 with a 0-d float32 weight_scale, and a 0-d input_scale when activations are
    static (random values: the layout only)."""
    quant = config["quantization_config"]
    not_converted = set(quant.get("ignored_layers") or quant.get("modules_to_not_convert") or [])
    rng = np.random.default_rng(seed + 19)
    out: Weights = {}
    shared: dict[str, tuple] = {}
    for name, (dtype, shape, raw) in weights.items():
        if not fp8_quantized(name, shape, not_converted, routers=False):
            out[name] = (dtype, shape, raw)
            continue
        stem = name.removesuffix("weight")
        out[name] = ("F8_E4M3", shape, rng.integers(0, 0x7F, size=shape, dtype=np.uint8).tobytes())
        out[stem + "weight_scale"] = ("F32", [], to_dtype_bytes(rng.uniform(1e-3, 1e-2, [1]), "F32"))
        if quant.get("activation_scheme") == "static":  # an expert's w1 and w3 share theirs, as calibrated
            key = _fused_input(stem) if ".experts." in stem else stem
            shared.setdefault(key, ("F32", [], to_dtype_bytes(rng.uniform(1e-3, 1e-2, [1]), "F32")))
            out[stem + "input_scale"] = shared[key]
    return out


def naive_quantized(weights: Weights, config: dict, seed: int = 0) -> Weights:
    """The checkpoint as a compressed-tensors W8A8 release ships it (the layout only: random 8-bit values,
    positive scales in the model dtype; tests/worker/shard/quant_checkpoint.py quantizes for real): each linear
    weight of the decoder layers becomes I8 (int-quantized) or F8_E4M3 (float-quantized) with weight_scale
    [out, 1] (channel) or [1] (tensor), and input_scale [1] where activations are static."""
    quant = config["quantization_config"]
    group = next(iter(quant["config_groups"].values()))
    args, inputs = group["weights"], group["input_activations"]
    rng = np.random.default_rng(seed + 18)
    out: Weights = {}
    shared: dict[str, dict] = {}
    for name, (dtype, shape, raw) in weights.items():
        if not fp8_quantized(name, shape, set(quant.get("ignore") or []), routers=False):
            out[name] = (dtype, shape, raw)
            continue
        stem, rows = name.removesuffix("weight"), shape[0]
        values = rng.integers(0, 0x7F, size=shape, dtype=np.uint8)  # positive, finite in both encodings
        out[name] = ("I8" if args["type"] == "int" else "F8_E4M3", shape, values.tobytes())
        scale_shape = [rows, 1] if args["strategy"] == "channel" else [1]
        out[stem + "weight_scale"] = (dtype, scale_shape, to_dtype_bytes(rng.uniform(1e-3, 1e-2, scale_shape), dtype))
        if not inputs.get("dynamic") and args["type"] == "int":  # one value per input, as calibration leaves it
            key = _fused_input(stem)
            if key not in shared:
                shared[key] = {"input_scale": (dtype, [1], to_dtype_bytes(rng.uniform(1e-3, 1e-2, [1]), dtype))}
                if inputs.get("symmetric") is False:
                    shared[key]["input_zero_point"] = ("I8", [1], rng.integers(-8, 8, [1], dtype=np.int8).tobytes())
            out.update((stem + suffix, value) for suffix, value in shared[key].items())
        elif not inputs.get("dynamic"):
            key = _fused_input(stem) if ".experts." in stem else stem  # an expert's w1 and w3 share theirs
            if key not in shared:
                shared[key] = {"input_scale": (dtype, [1], to_dtype_bytes(rng.uniform(1e-3, 1e-2, [1]), dtype))}
            out[stem + "input_scale"] = shared[key]["input_scale"]
    return out


def _fused_input(stem: str) -> str:
    """The input a linear module reads: q/k/v read one, gate/up another (INT8 static activations: the parts
    of a fused module share their calibrated input scale)."""
    for parts, fused in ((("q_proj.", "k_proj.", "v_proj."), "qkv."), (("gate_proj.", "up_proj."), "gate_up."),
                         ((".w1.", ".w3."), ".w13.")):
        for part in parts:
            if stem.endswith(part):
                return stem.removesuffix(part) + fused
    return stem


def int_packed(weights: Weights, config: dict, seed: int = 0) -> Weights:
    """The checkpoint as an AWQ (GEMM) or GPTQ release ships it (the layout only: random int32 words,
    positive scales; tests/worker/shard/quant_checkpoint.py quantizes for real): each linear weight [out, in]
    of the decoder layers becomes, stored [in, out], AWQ's qweight [in, out / 8], qzeros [groups, out / 8],
    scales [groups, out], or GPTQ's qweight [in / pack, out], scales, qzeros and g_idx [in] (I32)."""
    quant = config["quantization_config"]
    gptq, pack = quant["quant_method"] == "gptq", 32 // int(quant["bits"])
    rng = np.random.default_rng(seed + 17)
    words = lambda *shape: ("I32", list(shape), rng.integers(-2**31, 2**31, size=shape, dtype=np.int32).tobytes())
    out: Weights = {}
    for name, (dtype, shape, raw) in weights.items():
        if not fp8_quantized(name, shape, set(), routers=False):
            out[name] = (dtype, shape, raw)
            continue
        stem, (rows, cols) = name.removesuffix("weight"), shape
        group = cols if quant["group_size"] == -1 else quant["group_size"]
        groups = cols // group
        out[stem + "qweight"] = words(cols // pack, rows) if gptq else words(cols, rows // pack)
        out[stem + "qzeros"] = words(groups, rows // pack)
        out[stem + "scales"] = (dtype, [groups, rows], to_dtype_bytes(rng.uniform(1e-3, 1e-2, (groups, rows)), dtype))
        if gptq:
            out[stem + "g_idx"] = ("I32", [cols], (np.arange(cols, dtype=np.int32) // group).tobytes())
    return out


def safetensors_bytes(tensors: Weights) -> bytes:
    header, data, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        data.append(raw)
        offset += len(raw)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + b"".join(data)


def write_weights(directory: Path, weights: Weights, files: int = 1) -> None:
    names = list(weights)
    if files == 1:
        (directory / "model.safetensors").write_bytes(safetensors_bytes(weights))
        return
    weight_map = {}
    for n in range(files):
        file_name = f"model-{n + 1:05d}-of-{files:05d}.safetensors"
        chunk = names[n::files]
        (directory / file_name).write_bytes(safetensors_bytes({k: weights[k] for k in chunk}))
        weight_map |= {k: file_name for k in chunk}
    total = sum(len(raw) for _, _, raw in weights.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer covering every id of the model (so any generated
    id detokenizes), in the tokenizers library's JSON format."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab |= {f"w{i}": i for i in range(len(specials), vocab_size)}
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(specials)]
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                 "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
                 "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 512, "clean_up_tokenization_spaces": False}))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def write_checkpoint(directory: Path, case: ModelCase, seed: int = 0,
                     weights: Weights | None = None) -> Weights:
    """Write config, generation config, tokenizer and weights; return the weights."""
    directory.mkdir(parents=True, exist_ok=True)
    if weights is None:
        weights = random_weights(case.config, case.dtype, seed)
        method = (case.config.get("quantization_config") or {}).get("quant_method")
        if method == "compressed-tensors" and case.config["quantization_config"].get("format") in (
                "int-quantized", "float-quantized"):
            weights = naive_quantized(weights, case.config, seed)
        elif method == "compressed-tensors":
            weights = pack_quantized(weights, case.config, seed)
        elif method in ("awq", "gptq"):
            weights = int_packed(weights, case.config, seed)
        elif case.config.get("quantization_config", {}).get("weight_block_size") is None and method == "fp8":
            weights = fp8_tensor_scaled(weights, case.config, seed)
        elif case.config.get("quantization_config"):
            weights = fp8_block_scaled(weights, case.config, seed)
        for name in case.extra_tensors:  # e.g. a rotary buffer some exporters saved
            weights[name] = ("F32", [8], to_dtype_bytes(np.arange(8), "F32"))
    (directory / "config.json").write_text(json.dumps(case.config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": case.config["bos_token_id"], "eos_token_id": case.config["eos_token_id"],
         "do_sample": False, "transformers_version": "4.46.0"}))
    write_tokenizer(directory, case.config["vocab_size"])
    write_weights(directory, weights, case.files)
    return weights


def read_safetensors(path: Path) -> Weights:
    """Every tensor of a safetensors file as (dtype, shape, raw bytes)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    start = 8 + length
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        tensors[name] = (entry["dtype"], entry["shape"], data[start + begin:start + end])
    return tensors


def read_checkpoint(directory: Path) -> Weights:
    """Every tensor of every safetensors file in `directory`."""
    out: Weights = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(read_safetensors(path))
    return out
