"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python quant_checkpoint.py '[{"source": DIR, "output": DIR, "method": "compressed-tensors",
                                  "weights": {"num_bits": 4, "strategy": "group", "group_size": 32,
                                              "symmetric": true}},
                                 {"source": DIR, "output": DIR, "method": "awq", "group_size": 32},
                                 {"source": DIR, "output": DIR, "method": "gptq", "group_size": -1,
                                  "desc_act": true}]'

Quantized checkpoints as their quantizers write them, from SOURCE's bf16 weights
(round to nearest over min/max per group or per channel; each tensor stays in
the file it was in; config.json gains the quantizer's quantization_config):

- compressed-tensors `pack-quantized` (llm-compressor's serialization), by
  compressed-tensors' own code (0.17, the release vLLM 0.32 installs):
  `calculate_qparams`, then `PackedQuantizationCompressor.compress` writes
  weight_packed, weight_scale, weight_shape (and weight_zero_point when
  asymmetric);
- AWQ (AutoAWQ's GEMM layout) and GPTQ (AutoGPTQ's v1 layout), by vLLM's own
  reference quantizer and packers (quantization/utils/quant_utils.py:
  `quantize_weights`, `awq_pack`, `gptq_pack`, `pack_cols`; vLLM's kernel
  tests build their AWQ/GPTQ weights with them). AWQ: qweight [in, out/8] in
  AWQ's interleaved word order, qzeros [groups, out/8], scales [groups, out],
  with zero points; checked against AutoAWQ 0.2.9's WQLinear_GEMM.from_linear
  (same bytes; docs/worker-shard.md). GPTQ: qweight [in/8, out] packed along
  the input, symmetric (uint4b8), qzeros the v1 constant zero - 1, scales
  [groups, out], g_idx (i // group, or all 0 per channel).

- compressed-tensors W8A8 (int-quantized, float-quantized) by its naive
  compressor; INT8 static activations calibrated as llm-compressor's min/max
  observer does (`"calibrate": true`): transformers runs the bf16 model on
  fixed token ids, each Linear's input min/max goes through
  compressed-tensors' `calculate_qparams`, giving input_scale (and
  input_zero_point when asymmetric) per module, so the parts of a fused
  module, which read one input, get one value;

- per-tensor FP8 (quant_method "fp8" without weight_block_size, AutoFP8's
  layout): the weight in float8_e4m3fn under a 0-d float32 scale, and a 0-d
  input scale when activations are static.

An expert's w1 and w3 (gate and up) read the same input, so where activations
are static they get one input scale, the larger of the two (`shared_inputs`):
vLLM keeps one per expert, and compressed-tensors' MoE loader refuses two that
differ.

Only q/k/v/o and gate/up/down (Mixtral's experts: w1/w2/w3) of the decoder
layers are quantized; a job's `ignore` lists more modules the
quantization_config leaves alone (Qwen3-MoE's routers, which vLLM hands the
quant config, as the real releases list them).
"""
import json
import shutil
import sys
from pathlib import Path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def pack_quantized(weight, scheme):
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    w = weight.to(torch.float32)
    rows, cols = w.shape
    width = args.group_size if args.strategy == "group" else cols
    grouped = w.reshape(rows, cols // width, width)
    scale, zero = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), args)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero}
    return PackedQuantizationCompressor.compress(state, scheme)


def naive_quantized(weight, scheme):
    """compressed-tensors' int-quantized / float-quantized (W8A8): the 8-bit weight, its channel ([out, 1]) or
    tensor ([1]) scale in the weight's dtype, from min/max."""
    import torch
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    w = weight.to(torch.float32)
    if args.strategy == "channel":
        low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        low, high = w.amin().reshape(1), w.amax().reshape(1)
    scale, zero = calculate_qparams(low, high, args)
    state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero}
    out = NaiveQuantizationCompressor.compress(state, scheme)
    if scheme.input_activations is not None and not scheme.input_activations.dynamic and args.type == "float":
        # A static activation scale, as calibration would leave it (its value matters to no loader).
        out["input_scale"] = (w.abs().amax() / 127).reshape(1).to(weight.dtype)
    return out


CALIBRATION_IDS = [[1, 17, 42, 7, 99, 256, 3, 511, 64, 128, 9, 300, 21, 77, 5, 400]]


def calibrated_inputs(source: Path, job: dict) -> dict:
    """module -> {input_scale[, input_zero_point]}: each Linear's input min/max over CALIBRATION_IDS, through
    compressed-tensors' calculate_qparams (llm-compressor's min/max observer, static per tensor)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    args = QuantizationArgs(**job["input"])
    model = AutoModelForCausalLM.from_pretrained(str(source), torch_dtype=torch.bfloat16)
    seen: dict[str, list[float]] = {}

    def observe(name):
        def hook(module, inputs):
            x = inputs[0].float()
            low, high = seen.get(name, [0.0, 0.0])
            seen[name] = [min(low, x.min().item()), max(high, x.max().item())]
        return hook

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEARS and ".layers." in name:
            module.register_forward_pre_hook(observe(name))
    with torch.no_grad():
        model(torch.tensor(CALIBRATION_IDS) % model.config.vocab_size)
    out = {}
    for name, (low, high) in seen.items():
        scale, zero = calculate_qparams(torch.tensor([low]), torch.tensor([high]), args)
        out[name] = {"input_scale": scale.reshape(1).to(torch.bfloat16)}
        if not args.symmetric:
            out[name]["input_zero_point"] = zero.reshape(1).to(torch.int8)
    return out


def fp8_tensor(weight, static: bool) -> dict:
    """AutoFP8's per-tensor layout: the weight in float8_e4m3fn under one 0-d float32 scale (amax / 448), and
    a 0-d input scale when activations are static."""
    import torch

    scale = weight.to(torch.float32).abs().amax().clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    out = {"weight": (weight.to(torch.float32) / scale).to(torch.float8_e4m3fn), "weight_scale": scale.reshape(())}
    if static:
        out["input_scale"] = (weight.to(torch.float32).abs().amax() / 100).reshape(())
    return out


def awq(weight, group_size: int) -> dict:
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack, quantize_weights
    from vllm.scalar_type import scalar_types

    w = weight.to(torch.float32).t().contiguous()  # AWQ stores [in, out]
    size_k, size_n = w.shape
    _, q, scales, zeros = quantize_weights(w, scalar_types.uint4, group_size, zero_points=True)
    return {"qweight": awq_pack(q, 4, size_k, size_n), "qzeros": awq_pack(zeros, 4, size_k // group_size, size_n),
            "scales": scales.to(weight.dtype)}


def gptq(weight, group_size: int) -> dict:
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import gptq_pack, pack_cols, quantize_weights
    from vllm.scalar_type import scalar_types

    w = weight.to(torch.float32).t().contiguous()  # GPTQ stores [in, out]
    size_k, size_n = w.shape
    _, q, scales, _ = quantize_weights(w, scalar_types.uint4b8, group_size)
    groups = scales.shape[0]
    zeros = torch.full((groups, size_n), 7, dtype=torch.int32)  # v1: the symmetric zero 8, minus one
    width = size_k if group_size == -1 else group_size
    return {"qweight": gptq_pack(q, 4, size_k, size_n), "qzeros": pack_cols(zeros, 4, groups, size_n),
            "scales": scales.to(weight.dtype), "g_idx": (torch.arange(size_k) // width).to(torch.int32)}


def quantizer(job: dict):
    """(tensors of one Linear weight, quantization_config) for the job's method."""
    method = job["method"]
    if method == "compressed-tensors":
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(type="int", **job["weights"]))
        return lambda w: pack_quantized(w, scheme), {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {**json.loads(scheme.model_dump_json()), "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "version": compressed_tensors.__version__}
    if method == "compressed-tensors-w8a8":
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        fmt = "int-quantized" if job["weights"]["type"] == "int" else "float-quantized"
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**job["weights"]),
                                    input_activations=QuantizationArgs(**job["input"]))
        return lambda w: naive_quantized(w, scheme), {
            "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {**json.loads(scheme.model_dump_json()), "format": fmt}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "version": compressed_tensors.__version__}
    if method == "fp8":  # per tensor, as AutoFP8 writes it
        static = job.get("activation_scheme") == "static"
        return lambda w: fp8_tensor(w, static), {"quant_method": "fp8", "activation_scheme": job["activation_scheme"],
                                                 "ignored_layers": ["lm_head"]}
    group = job["group_size"]
    if method == "awq":
        return lambda w: awq(w, group), {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": None}
    assert method == "gptq", method
    return lambda w: gptq(w, group), {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": job.get("desc_act", False),
        "sym": True, "lm_head": False, "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
        "checkpoint_format": "gptq"}


EXPERT_GATE_UP = (("w1", "w3"), ("gate_proj", "up_proj"))


def shared_inputs(tensors: dict) -> None:
    """Each expert's gate and up input scales set to the larger of the two (both in `tensors`)."""
    for name in [n for n in tensors if n.endswith(".input_scale") and ".experts." in n]:
        module = name.removesuffix(".input_scale")
        prefix, _, part = module.rpartition(".")
        for gate, up in EXPERT_GATE_UP:
            if part == gate:
                other = f"{prefix}.{up}.input_scale"
                larger = tensors[name].maximum(tensors[other])
                tensors[name], tensors[other] = larger, larger.clone()


def main(source: Path, output: Path, job: dict) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    quantize, quantization_config = quantizer(job)
    calibrated = calibrated_inputs(source, job) if job.get("calibrate") else {}
    output.mkdir(parents=True)
    index = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                module, _, leaf = name.rpartition(".")
                if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
                    for key, value in {**quantize(tensor), **calibrated.get(module, {})}.items():
                        tensors[f"{module}.{key}"] = value.contiguous()
                else:
                    tensors[name] = tensor
        shared_inputs(tensors)
        save_file(tensors, str(output / path.name), metadata={"format": "pt"})
        index.update({name: path.name for name in tensors})
    for companion in source.iterdir():
        if companion.suffix != ".safetensors" and companion.name != "model.safetensors.index.json":
            shutil.copy(companion, output / companion.name)
    if (source / "model.safetensors.index.json").exists():
        (output / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = json.loads((source / "config.json").read_text())
    ignored = quantization_config.get("ignore")
    quantization_config = {**quantization_config, "ignore": [*ignored, *job.get("ignore", [])]} if ignored is not None \
        else quantization_config
    config["quantization_config"] = quantization_config
    (output / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    for job in json.loads(sys.argv[1]):  # one process for all: the imports dominate
        main(Path(job["source"]), Path(job["output"]), job)
