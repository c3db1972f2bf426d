"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python ct_checkpoint.py '[{"source": DIR, "output": DIR, "weights": {"num_bits": 4, "strategy": "group",
                                                                       "group_size": 32, "symmetric": true}}]'

A compressed-tensors `pack-quantized` checkpoint as llm-compressor writes one,
made with compressed-tensors' own code (0.17, the release vLLM 0.32 installs):
each Linear weight of SOURCE's decoder layers (q/k/v/o, gate/up/down) gets its
quantization parameters from `calculate_qparams` over min/max per group (or per
channel), and `PackedQuantizationCompressor.compress` writes weight_packed,
weight_scale, weight_shape (and weight_zero_point when asymmetric). Every other
tensor is copied; each tensor stays in the file it was in. config.json gains
the quantization_config compressed-tensors serializes for that scheme.
"""
import json
import shutil
import sys
from pathlib import Path

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized(weight, scheme):
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


def main(source: Path, output: Path, weights: dict) -> None:
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors import safe_open
    from safetensors.torch import save_file

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(type="int", **weights))
    output.mkdir(parents=True)
    index = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors = {}
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                tensor = f.get_tensor(name)
                module, _, leaf = name.rpartition(".")
                if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
                    for key, value in quantized(tensor, scheme).items():
                        tensors[f"{module}.{key}"] = value.contiguous()
                else:
                    tensors[name] = tensor
        save_file(tensors, str(output / path.name), metadata={"format": "pt"})
        index.update({name: path.name for name in tensors})
    for companion in source.iterdir():
        if companion.suffix != ".safetensors" and companion.name != "model.safetensors.index.json":
            shutil.copy(companion, output / companion.name)
    if (source / "model.safetensors.index.json").exists():
        (output / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {**json.loads(scheme.model_dump_json()), "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "version": compressed_tensors.__version__}
    (output / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    for job in json.loads(sys.argv[1]):  # one process for all: the imports dominate
        main(Path(job["source"]), Path(job["output"]), job["weights"])
