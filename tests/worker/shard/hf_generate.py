"""Run by the vLLM venv's python (it has transformers), not by pytest.

    python hf_generate.py OUT_DIR CASE [OUT_DIR CASE ...]
    CASE = a family name below (e.g. "mixtral"), or a JSON object
           {"model_type": "mixtral", "config": {...}, "dtype": "bfloat16", "seed": 0}
           where a "family" key starts from that family's config and "config" overrides it;
           "fp8": {"block": [128, 128], "not_converted": [...], "routers": false} quantizes the
           saved checkpoint as an FP8 block-scaled release (quantize_fp8).

Builds a tiny random model with transformers' own modelling code
(`AutoConfig.for_model` / `AutoModelForCausalLM.from_config`) and writes it with
`save_pretrained(safe_serialization=True)`, plus a word-level tokenizer. So the
checkpoint's tensor names and shapes are the ones transformers writes for a
real release of the family (e.g. per-expert `experts.{e}.w1` names), not ones
written from Ferry's layout tables. Prints `CHECKPOINT {json}` with the saved
tensors (name -> [shape, dtype]), one line per pair, in order: several checkpoints
cost one import of torch and transformers (tests/hf_checkpoints.py batches them).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "e2e"))
from checkpoints import fp8_block_config, fp8_quantized, write_tokenizer  # noqa: E402  (json/numpy only)

CHECKPOINT_PREFIX = "CHECKPOINT "
VOCAB = 1000

# Tiny versions of real releases: hidden 128 (vLLM's CPU MoE needs hidden % 32 == 0),
# 2 layers, 4 heads / 2 KV heads, 4 experts with top-k 2.
_COMMON = {"hidden_size": 128, "num_hidden_layers": 2, "vocab_size": VOCAB, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 256, "max_position_embeddings": 512,
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}

FAMILIES: dict[str, dict] = {
    # Mixtral-8x7B: every layer sparse, router `block_sparse_moe.gate`, experts w1/w2/w3.
    "mixtral": {"model_type": "mixtral", "config": {
        **_COMMON, "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False,
        "router_aux_loss_coef": 0.02}},
    # Qwen3-30B-A3B: q/k norms, head_dim 32 here, every layer sparse, normalized top-k.
    "qwen3_moe": {"model_type": "qwen3_moe", "config": {
        **_COMMON, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None}},
    # MLA: vLLM's CPU MLA backend only runs the real latent size, kv_lora_rank 512 +
# rope 64 = 576 ("Head dimension 80 is not supported by MLA" otherwise).
# DeepSeek-V2-Lite: MLA without q LoRA (plain q_proj), 2 shared experts, layer 0 dense,
    # greedy softmax routing.
    "deepseek_v2": {"model_type": "deepseek_v2", "config": {
        **_COMMON, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 2,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "aux_loss_alpha": 0.001, "seq_aux": True}},
    # DeepSeek-V3: MLA with q LoRA, 1 shared expert, grouped sigmoid routing with the
    # e_score_correction_bias (noaux_tc), layer 0 dense.
    "deepseek_v3": {"model_type": "deepseek_v3", "config": {
        **_COMMON, "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64, "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "num_nextn_predict_layers": 0}},
    # Gemma-2-2B: tied, head_dim from config, soft-capping, alternating sliding window,
    # four norms per layer stored as (weight - 1).
    "gemma2": {"model_type": "gemma2", "config": {
        **_COMMON, "head_dim": 32, "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True}},
    # Gemma-3-1B (text only): q/k norms, tied, 5 local : 1 global layers (2 layers here).
    "gemma3_text": {"model_type": "gemma3_text", "config": {
        **_COMMON, "head_dim": 32, "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"],
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "final_logit_softcapping": None,
        "attn_logit_softcapping": None}},
    # Phi-3-mini-4k (with GQA as Phi-3-medium has): fused qkv_proj and gate_up_proj, untied.
    "phi3": {"model_type": "phi3", "config": {
        **_COMMON, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": 2047,
        "original_max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu",
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0}},
}


def resolve_case(case: str) -> dict:
    if case in FAMILIES:
        return {**FAMILIES[case], "family": case}
    spec = json.loads(case)
    base = FAMILIES.get(spec.get("family", ""), {"model_type": spec.get("model_type"), "config": {}})
    return {**base, **spec, "config": {**base["config"], **spec.get("config", {})}}


def _norm_neutral(weight: torch.Tensor) -> float:
    """1 for x * w norms, 0 for Gemma's x * (1 + w): the value transformers
    initializes the norm to."""
    return 0.0 if bool((weight == 0).all()) else 1.0


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Scaled like e2e/checkpoints.py random_weights: the decoder layers, not the
    token's own embedding, decide the next token, and the final norm restores
    the logits' spread so greedy choices are rarely near-ties."""
    generator = torch.Generator().manual_seed(seed)
    # Gemma multiplies the embeddings by sqrt(hidden) and ties the LM head: at
    # 0.1 the token's own embedding outweighs the (norm-bounded) layer outputs
    # and greedy decoding just repeats the prompt's last token.
    hidden = model.config.get_text_config().hidden_size
    embed_std = 0.05 / hidden ** 0.5 if model.config.model_type.startswith("gemma") else 0.1
    final_norm = model.get_decoder().norm
    modules = dict(model.named_modules())
    saved = set(model.state_dict())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        owner = modules[name.rpartition(".")[0]]
        # Drawn for every tensor, so the stream (and the checkpoint) does not
        # depend on which ones are skipped below.
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        if name not in saved:
            continue  # non-persistent buffers (Gemma's embed_scale, rotary inv_freq): computed, not weights
        if "norm" in type(owner).__name__.lower() or name.endswith("layernorm.weight"):
            neutral = _norm_neutral(tensor)
            # The final norm sets the logits' spread: with a tied head that is
            # proportional to the embedding scale, so undo Gemma's smaller one.
            scale = 10.0 * 0.1 / embed_std if owner is final_norm else 1.0
            # Gemma computes x * (1 + w): store w so (1 + w) gets the same spread.
            values = scale * (1.0 + 0.1 * noise) - (1.0 - neutral)
        elif name.endswith("e_score_correction_bias"):
            values = 0.05 * noise  # nonzero so a wrong placement changes routing
        elif isinstance(owner, torch.nn.Embedding) or name == "lm_head.weight":
            values = embed_std * noise
        elif not tensor.is_floating_point():
            continue
        else:
            values = 0.08 * noise
        tensor.copy_(values.to(tensor.dtype))


@torch.no_grad()
def keep_fp32(model: torch.nn.Module) -> None:
    """`from_config(dtype=...)` casts everything, but releases store the
    modules the model class keeps in float32 (DeepSeek-V3's
    e_score_correction_bias) as F32: restore that."""
    patterns = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    modules = dict(model.named_modules())
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if any(p in name for p in patterns):
            owner, _, attr = name.rpartition(".")
            fp32 = tensor.data.float()
            if isinstance(tensor, torch.nn.Parameter):
                setattr(modules[owner], attr, torch.nn.Parameter(fp32, requires_grad=False))
            else:
                modules[owner].register_buffer(attr, fp32)


def build(out_dir: Path, case: dict) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    config = AutoConfig.for_model(case["model_type"], **case["config"])
    torch.manual_seed(case.get("seed", 0))
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    randomize(model, case.get("seed", 0))
    keep_fp32(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer(out_dir, config.vocab_size)
    if case.get("fp8"):
        quantize_fp8(out_dir, **case["fp8"])
    return saved_tensors(out_dir)


FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


@torch.no_grad()
def quantize_fp8(out_dir: Path, block: list[int], not_converted: list[str] = (), routers: bool = False) -> None:
    """Rewrite the saved checkpoint as an FP8 block-scaled release (DeepSeek-V3's
    recipe): per bn x bk tile of each quantized weight, scale = amax / 448 and
    the float8_e4m3fn weight = w / scale; `weight_scale_inv` (float32,
    [ceil(out/bn), ceil(in/bk)]) is the dequantization factor. Which tensors:
    checkpoints.fp8_quantized; config.json gets the quantization_config."""
    from safetensors.torch import load_file, save_file

    bn, bk = block
    if (out_dir / "model.safetensors.index.json").exists():
        raise SystemExit("quantize_fp8 writes scales into the files themselves: keep the model to one file")
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(path)
        out = {}
        for name, w in tensors.items():
            if not fp8_quantized(name, list(w.shape), set(not_converted), routers):
                out[name] = w
                continue
            rows, cols = w.shape
            padded = torch.zeros(-(-rows // bn) * bn, -(-cols // bk) * bk, dtype=torch.float32)
            padded[:rows, :cols] = w.float()
            tiles = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
            scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
            q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(padded.shape)[:rows, :cols]
            out[name] = q.to(torch.float8_e4m3fn).contiguous()
            out[name + "_scale_inv"] = scale.contiguous()
        save_file(out, str(path), metadata={"format": "pt"})
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(fp8_block_config(config, list(block), tuple(not_converted)), indent=2))


def saved_tensors(out_dir: Path) -> dict:
    from safetensors import safe_open

    tensors = {}
    for path in sorted(out_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                tensors[key] = [list(t.get_shape()), t.get_dtype()]
    return tensors


def main() -> None:
    args = sys.argv[1:]
    if not args or len(args) % 2:
        raise SystemExit("usage: hf_generate.py OUT_DIR CASE [OUT_DIR CASE ...]")
    for out_dir, raw in zip(args[::2], args[1::2]):
        case = resolve_case(raw)
        tensors = build(Path(out_dir), case)
        print(CHECKPOINT_PREFIX + json.dumps({"family": case.get("family"), "model_type": case["model_type"],
                                              "tensors": tensors}), flush=True)


if __name__ == "__main__":
    main()
