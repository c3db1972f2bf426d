"""Write a tiny FP8 block-scaled (DeepSeek-V3 / Qwen3-FP8 style) Llama
checkpoint by hand: every decoder Linear -> `<m>.weight` float8_e4m3fn +
`<m>.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)]; embedding,
norms and lm_head stay bf16. Usage: make_fp8_ckpt.py OUT_DIR"""
import json, math, os, sys
import torch
from safetensors.torch import save_file

B = 128
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (B x B) tile: scale = amax/448, q = w/scale; dequant is q * scale (the
    'inv' in weight_scale_inv is historical: it is the dequantization multiplier)."""
    out, inp = w.shape
    po, pi = math.ceil(out / B) * B, math.ceil(inp / B) * B
    padded = torch.zeros(po, pi, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    tiles = padded.view(po // B, B, pi // B, B)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(po, pi)[:out, :inp]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def main(out_dir: str) -> None:
    H, I, L, HEADS, KV, HD, V = 256, 512, 2, 4, 2, 128, 320  # every per-rank part a multiple of 128 up to tp 4
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 0.02)
    t = {"model.embed_tokens.weight": rnd(V, H).bfloat16(), "model.norm.weight": torch.ones(H).bfloat16(),
         "lm_head.weight": rnd(V, H).bfloat16()}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(H).bfloat16()
        t[p + "post_attention_layernorm.weight"] = torch.ones(H).bfloat16()
        for name, shape in (("self_attn.q_proj", (HEADS * HD, H)), ("self_attn.k_proj", (KV * HD, H)),
                            ("self_attn.v_proj", (KV * HD, H)), ("self_attn.o_proj", (H, HEADS * HD)),
                            ("mlp.gate_proj", (I, H)), ("mlp.up_proj", (I, H)), ("mlp.down_proj", (H, I))):
            t[p + name + ".weight"], t[p + name + ".weight_scale_inv"] = quantize_block(rnd(*shape))
    os.makedirs(out_dir, exist_ok=True)
    save_file(t, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "head_dim": HD, "vocab_size": V, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "bfloat16",
              "tie_word_embeddings": False,
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [B, B]}}
    json.dump(config, open(os.path.join(out_dir, "config.json"), "w"), indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
