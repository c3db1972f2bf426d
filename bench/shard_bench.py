"""Benchmark `ferry shard` against `cp -r` of the same checkpoint, in one run.

    .venv/bin/python bench/shard_bench.py [--workdir DIR] [--layers 8] [--tp 4] [--runs 3] [--baseline CMD]
                                          [--model mixtral [--expert-parallel]] [--fp8 | --w4a16 | --awq]

Generates a Llama-3-8B-shaped checkpoint (hidden 4096, 32 heads, 8 KV heads,
intermediate 14336, vocab 128256, bf16; `--layers` decoder layers: 8 gives
5.6 GB) split like a Hub repository, then times, alternating, `cp -r` (and
`cp -r` followed by `sync`, since ferry fsyncs every file before it publishes
it) and `ferry shard --tensor-parallel-size TP`, each from a cold page cache
when the kernel lets us drop it. Reports medians, the ratio cp/ferry, ferry's
peak RSS (GNU time), and the bytes each rank reads to load: its
rank files versus the whole checkpoint vLLM's default loader reads on every
rank. `--layers 5` gives 4.28 GB (4 GiB). `--baseline` times a second ferry
command (e.g. another checkout) in the same alternation, so that two releases
are compared under the same disk and load. `--fp8` writes the checkpoint as an
FP8 block-scaled release (DeepSeek-V3's layout: every decoder linear weight
F8_E4M3 with a float32 `weight_scale_inv` per 128 x 128 block, the rest bf16),
so that the block-unit scale cuts are timed too. `--w4a16` writes it as a
compressed-tensors pack-quantized W4A16 release (llm-compressor's layout: every
decoder linear weight int4 packed into I32 `weight_packed` [out, in/8], a bf16
`weight_scale` per 128 inputs and an I64 `weight_shape`), the packed cuts
timed. `--awq` writes it as an AutoAWQ GEMM release (every decoder linear
weight stored [in, out]: I32 `qweight` [in, out/8], I32 `qzeros` and bf16
`scales` per 128 inputs), so the column cuts of fused modules, side by side
along dim 1, are timed. Everything it writes is removed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cache_state import try_drop_page_cache  # noqa: E402

HIDDEN, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 4096, 32, 8, 14336, 128256
HEAD_DIM = HIDDEN // HEADS
FILE_LIMIT = 2 << 30  # Hub checkpoints are split in files of a few GB
POOL_BYTES = 64 << 20  # random bytes, written over and over: content does not matter here
FP8_BLOCK = 128
GNU_TIME = "/usr/bin/time"  # Debian package `time`


def llama_config(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": layers, "vocab_size": VOCAB, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
            "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"}


def attention_shapes(p: str) -> dict[str, list[int]]:
    """Llama-3-8B's (and Mixtral's) attention and norms of the layer with prefix `p`."""
    return {p + "self_attn.q_proj.weight": [HEADS * HEAD_DIM, HIDDEN],
            p + "self_attn.k_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
            p + "self_attn.v_proj.weight": [KV_HEADS * HEAD_DIM, HIDDEN],
            p + "self_attn.o_proj.weight": [HIDDEN, HEADS * HEAD_DIM],
            p + "input_layernorm.weight": [HIDDEN], p + "post_attention_layernorm.weight": [HIDDEN]}


def tensor_shapes(layers: int) -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [VOCAB, HIDDEN]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= attention_shapes(p)
        shapes |= {p + "mlp.gate_proj.weight": [INTERMEDIATE, HIDDEN],
                   p + "mlp.up_proj.weight": [INTERMEDIATE, HIDDEN],
                   p + "mlp.down_proj.weight": [HIDDEN, INTERMEDIATE]}
    return shapes | {"model.norm.weight": [HIDDEN], "lm_head.weight": [VOCAB, HIDDEN]}


# `--model mixtral`: Mixtral-8x7B's attention and 8 experts, top 2, with the expert intermediate size
# scaled from 14336 to 4096 so that 4 layers make a checkpoint of a few GiB (4 layers: 3.7 GB).
EXPERTS, EXPERT_INTERMEDIATE, MIXTRAL_VOCAB = 8, 4096, 32000


def mixtral_config(layers: int) -> dict:
    return {**llama_config(layers), "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": EXPERT_INTERMEDIATE, "num_local_experts": EXPERTS, "num_experts_per_tok": 2,
            "vocab_size": MIXTRAL_VOCAB, "rope_theta": 1e6, "bos_token_id": 1, "eos_token_id": 2}


def mixtral_shapes(layers: int) -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [MIXTRAL_VOCAB, HIDDEN]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= attention_shapes(p) | {p + "block_sparse_moe.gate.weight": [EXPERTS, HIDDEN]}
        for e in range(EXPERTS):
            x = f"{p}block_sparse_moe.experts.{e}."
            shapes |= {x + "w1.weight": [EXPERT_INTERMEDIATE, HIDDEN], x + "w2.weight": [HIDDEN, EXPERT_INTERMEDIATE],
                       x + "w3.weight": [EXPERT_INTERMEDIATE, HIDDEN]}
    return shapes | {"model.norm.weight": [HIDDEN], "lm_head.weight": [MIXTRAL_VOCAB, HIDDEN]}


MODELS = {"llama": (llama_config, tensor_shapes), "mixtral": (mixtral_config, mixtral_shapes)}


def fp8_tensors(shapes: dict[str, list[int]]) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of an FP8 block-scaled release: decoder linear weights (not routers) F8_E4M3
    plus their float32 block scales; embeddings, norms and the LM head bf16."""
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers.") and len(shape) == 2 and not name.endswith(".gate.weight"):
            tensors[name] = ("F8_E4M3", shape)
            tensors[name + "_scale_inv"] = ("F32", [-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)])
        else:
            tensors[name] = ("BF16", shape)
    return tensors


W4A16_GROUP = 128


def w4a16_tensors(shapes: dict[str, list[int]]) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of a pack-quantized W4A16 release: decoder linear weights (not routers) packed
    8 int4 values per I32, bf16 group scales and the I64 unpacked shape; the rest bf16."""
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers.") and len(shape) == 2 and not name.endswith(".gate.weight"):
            stem = name.removesuffix("weight")
            tensors[stem + "weight_packed"] = ("I32", [shape[0], shape[1] // 8])
            tensors[stem + "weight_scale"] = ("BF16", [shape[0], shape[1] // W4A16_GROUP])
            tensors[stem + "weight_shape"] = ("I64", [2], shape)
        else:
            tensors[name] = ("BF16", shape)
    return tensors


def awq_tensors(shapes: dict[str, list[int]]) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of an AutoAWQ GEMM release: decoder linear weights (not routers) as I32 qweight
    [in, out / 8], I32 qzeros [in / 128, out / 8], bf16 scales [in / 128, out]; the rest bf16."""
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, shape in shapes.items():
        if name.startswith("model.layers.") and len(shape) == 2 and not name.endswith(".gate.weight"):
            stem, (out, inputs) = name.removesuffix("weight"), shape
            tensors[stem + "qweight"] = ("I32", [inputs, out // 8])
            tensors[stem + "qzeros"] = ("I32", [inputs // W4A16_GROUP, out // 8])
            tensors[stem + "scales"] = ("BF16", [inputs // W4A16_GROUP, out])
        else:
            tensors[name] = ("BF16", shape)
    return tensors


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": W4A16_GROUP, "zero_point": True, "version": "gemm"}
W4A16_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": W4A16_GROUP}}}}


def write_checkpoint(directory: Path, layers: int, model: str = "llama", fp8: bool = False,
                     w4a16: bool = False, awq: bool = False) -> int:
    """A checkpoint in files of at most FILE_LIMIT bytes of data, with an index. Returns its size."""
    from ferry_worker.shard.tensors import HeaderEntry, encode_header

    config, shapes = MODELS[model]
    tensors = (fp8_tensors(shapes(layers)) if fp8 else w4a16_tensors(shapes(layers)) if w4a16
               else awq_tensors(shapes(layers)) if awq else {n: ("BF16", s) for n, s in shapes(layers).items()})
    values = {n: struct.pack("<2q", *t[2]) for n, t in tensors.items() if len(t) == 3}  # weight_shape
    tensors = {n: t[:2] for n, t in tensors.items()}
    directory.mkdir(parents=True)
    settings = config(layers)
    if fp8:
        settings["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    if w4a16:
        settings["quantization_config"] = W4A16_CONFIG
    if awq:
        settings["quantization_config"] = AWQ_CONFIG
    (directory / "config.json").write_text(json.dumps(settings, indent=2))
    (directory / "generation_config.json").write_text('{"bos_token_id": 128000, "eos_token_id": 128001}')
    groups: list[list[tuple[str, str, list[int]]]] = [[]]
    size = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = HeaderEntry(name, dtype, tuple(shape)).nbytes
        if groups[-1] and size + nbytes > FILE_LIMIT:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, shape))
        size += nbytes
    pool = memoryview(os.urandom(POOL_BYTES))
    weight_map, total = {}, 0
    for n, group in enumerate(groups):
        file_name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        entries = [HeaderEntry(name, dtype, tuple(shape)) for name, dtype, shape in group]
        with open(directory / file_name, "wb") as f:
            f.write(encode_header(entries))
            for entry in entries:
                if entry.name in values:
                    f.write(values[entry.name])
                    continue
                left = entry.nbytes
                while left:
                    chunk = pool[:min(left, POOL_BYTES)]
                    f.write(chunk)
                    left -= len(chunk)
        weight_map |= {name: file_name for name, _, _ in group}
        total += (directory / file_name).stat().st_size
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def timed(argv: list[str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS (bytes) and CPU seconds (user + system) of one command.

    These come from GNU time, not from wait4 here: a child forked from this
    process starts with this process's pages in its ru_maxrss.
    """
    with tempfile.NamedTemporaryFile("r") as usage:
        start = time.perf_counter()
        subprocess.run([GNU_TIME, "-f", "%M %U %S", "-o", usage.name, *argv], stdout=subprocess.DEVNULL, check=True)
        elapsed = time.perf_counter() - start
        rss, user, system = usage.read().split()[-3:]
        return elapsed, int(rss) * 1024, float(user) + float(system)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", choices=sorted(MODELS), default="llama",
                    help="llama: Llama-3-8B-shaped; mixtral: Mixtral-8x7B-shaped with smaller experts")
    ap.add_argument("--expert-parallel", action="store_true", help="mixtral: cut whole experts per rank")
    ap.add_argument("--fp8", action="store_true", help="an FP8 block-scaled checkpoint (128 x 128 blocks)")
    ap.add_argument("--w4a16", action="store_true", help="a compressed-tensors pack-quantized W4A16 checkpoint")
    ap.add_argument("--awq", action="store_true", help="an AutoAWQ GEMM checkpoint (4-bit, group 128)")
    ap.add_argument("--ferry", default=f"{sys.executable} -m ferry_worker.cli",
                    help="the ferry command to time (default: %(default)s)")
    ap.add_argument("--baseline", help="another ferry command, timed in the same runs (e.g. 'env "
                                       "PYTHONPATH=/tmp/base/worker_image .venv/bin/python -m ferry_worker.cli')")
    args = ap.parse_args()
    if not Path(GNU_TIME).exists():
        raise SystemExit(f"{GNU_TIME} is needed for peak RSS (apt-get install time)")

    root = Path(tempfile.mkdtemp(prefix="ferry-shard-bench-", dir=args.workdir))
    try:
        source = root / "checkpoint"
        checkpoint_bytes = write_checkpoint(source, args.layers, args.model, args.fp8, args.w4a16, args.awq)
        if shutil.disk_usage(root).free < 2.5 * checkpoint_bytes:
            raise SystemExit(f"{root}: needs {2.5 * checkpoint_bytes / 1e9:.1f} GB free for the copies")
        ferries = {"ferry shard": args.ferry} | ({"ferry shard (baseline)": args.baseline} if args.baseline else {})
        times: dict[str, list[float]] = {"cp -r": [], "cp -r; sync": [], **{label: [] for label in ferries}}
        peak_rss, cpu, cold = dict.fromkeys(ferries, 0), {label: [] for label in ferries}, True
        for _ in range(args.runs):
            for label in times:
                target = root / "copy"
                cold &= try_drop_page_cache()
                if label in ferries:
                    elapsed, rss, cpu_seconds = timed([*ferries[label].split(), "shard", "--source", str(source), "--output",
                                          str(target), "--tensor-parallel-size", str(args.tp),
                                          *(["--expert-parallel"] if args.expert_parallel else [])])
                    peak_rss[label] = max(peak_rss[label], rss)
                    cpu[label].append(cpu_seconds)
                    rank_bytes = _rank_bytes(target, args.tp)
                else:
                    command = f"cp -r {source} {target}" + ("; sync" if "sync" in label else "")
                    elapsed, _, _ = timed(["bash", "-c", command])
                times[label].append(elapsed)
                shutil.rmtree(target)
        median = {label: statistics.median(values) for label, values in times.items()}
        report = {
            "checkpoint": {"model": args.model, "layers": args.layers, "fp8": args.fp8, "w4a16": args.w4a16, "awq": args.awq,
                           "bytes": checkpoint_bytes,
                           "files": len(list(source.glob("*.safetensors")))},
            "tensorParallelSize": args.tp,
            "expertParallel": args.expert_parallel,
            "runs": args.runs,
            "pageCache": "dropped before every run" if cold else "warm (could not drop it)",
            "seconds": times,
            "medianSeconds": median,
            # SHA-256 is most of ferry's CPU: where the disk is fast, this is what bounds its wall time.
            "medianCpuSeconds": {label: statistics.median(values) for label, values in cpu.items()},
            "ratioCpOverFerry": median["cp -r"] / median["ferry shard"],
            "ratioCpSyncOverFerry": median["cp -r; sync"] / median["ferry shard"],
            **({"ratioCpSyncOverBaseline": median["cp -r; sync"] / median["ferry shard (baseline)"],
                "ratioBaselineOverFerry": median["ferry shard (baseline)"] / median["ferry shard"]}
               if args.baseline else {}),
            "ferryPeakRssBytes": peak_rss["ferry shard"],
            **({"baselinePeakRssBytes": peak_rss["ferry shard (baseline)"]} if args.baseline else {}),
            "bytesReadPerRankToLoad": {"ferryRankFiles": rank_bytes, "vllmDefaultLoader": checkpoint_bytes},
        }
        print(json.dumps(report, indent=2))
        return 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _rank_bytes(artifact: Path, tp: int) -> list[int]:
    return [sum(p.stat().st_size for p in artifact.glob(f"model-rank-{r}-part-*.safetensors")) for r in range(tp)]


if __name__ == "__main__":
    sys.exit(main())
