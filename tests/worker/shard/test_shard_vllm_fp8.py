"""FP8 block-scaled checkpoints: Ferry's `sharded_state` rank files against the
state vLLM 0.32 itself builds in each TP 2 worker (and EP 2 for the MoE
families), name for name, dtype, shape and byte for byte; and Qwen3-MoE at
TP 4, where each rank's expert intermediate size is not whole 128 blocks and
vLLM's default MoE backend refines the experts' scale grid (Qwen3-30B-A3B-FP8
at TP 4: 64 blocks; here 256 / 4. The 32-wide grid, Qwen3-30B-A3B-FP8 at
TP 8, stays a unit test in test_shard_fp8.py: its state run, 384 / 4, was
equal by hand on 2026-12-05 and left out of CI for its budget).

Shares: the session's hf_checkpoints store, and one vLLM process per TP size
for all its runs.

The checkpoints are written by transformers' own modelling code
(hf_generate.py) and then quantized as DeepSeek-V3's recipe does (per
128x128 tile: scale = amax / 448, float8_e4m3fn weight, float32
`weight_scale_inv`), with sizes for which every rank's slice is whole blocks,
as in the real releases. vllm_fp8_state.py loads each in every worker with
vLLM's default loader (vLLM's own weight loaders cut each weight and scale)
and Ferry's artifact with ShardedStateLoader, both before
process_weights_after_loading, and reports both state_dicts.

Not proven here: generation. vLLM's CPU FP8 kernels need AMX, which this
project's machines do not all have; FP8 tokens are unproven until a GPU run
(the README says so).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ferry_worker.manifest import read_manifest
from ferry_worker.shard.experts import MoeTarget
from ferry_worker.shard.job import ShardJob

from vllm_tokens import CPU_ENGINE_ENV, assert_workers_built_the_same_state, run_engines

HERE = Path(__file__).parent
STATE = HERE / "vllm_fp8_state.py"
BLOCK = [128, 128]
_DENSE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
          "intermediate_size": 512}
# MLA at whole blocks per rank: q_b 4 x (64 + 64) / 2, kv_b 4 x (64 + 64) / 2, o_proj's input 4 x 64 / 2.
_MLA = {"hidden_size": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 64,
        "moe_intermediate_size": 256, "intermediate_size": 256}


@dataclass(frozen=True)
class Checkpoint:
    name: str
    family: str  # hf_generate.py's
    config: dict
    expert_parallel: bool = False  # also cut and compared at EP 2
    not_converted: tuple[str, ...] = ()
    routers: bool = False  # quantize the MoE routers too (Qwen3-MoE hands its gate the quant config)
    fp8: dict = field(default_factory=dict)
    tp: int = 2
    refined: tuple[int, int] | None = None  # the experts' scale grid refinement vLLM applies at `tp`


CHECKPOINTS = (
    Checkpoint("llama", "", {"model_type": "llama", "family": None, "config": {
        **_DENSE, "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}}),
    Checkpoint("qwen3", "", {"model_type": "qwen3", "config": {
        **_DENSE, "num_hidden_layers": 2, "vocab_size": 1000, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}}),
    Checkpoint("phi3", "phi3", {"config": {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                                           "intermediate_size": 512}}),
    Checkpoint("gemma3", "gemma3_text", {"config": {**_DENSE, "query_pre_attn_scalar": 128}}),
    Checkpoint("mixtral", "mixtral", {"config": {**_DENSE, "intermediate_size": 256}}, expert_parallel=True),
    # Qwen3-*-FP8 keep every router in bf16 and say so; without that vLLM quantizes the gate too.
    Checkpoint("qwen3_moe", "qwen3_moe", {"config": {**_DENSE, "moe_intermediate_size": 256}}, expert_parallel=True,
               not_converted=("model.layers.0.mlp.gate", "model.layers.1.mlp.gate")),
    Checkpoint("qwen3_moe-fp8-router", "qwen3_moe", {"config": {**_DENSE, "moe_intermediate_size": 256}},
               routers=True),
    Checkpoint("deepseek_v2", "deepseek_v2", {"config": {**_MLA, "n_shared_experts": 2}}),
    Checkpoint("deepseek_v3", "deepseek_v3", {"config": {**_MLA, "q_lora_rank": 128}}, expert_parallel=True),
    # 64 and 96 expert rows per rank at TP 4: vLLM refines 128x128 to 64x64 and 32x32.
    Checkpoint("qwen3_moe-refined64", "qwen3_moe", {"config": {**_DENSE, "moe_intermediate_size": 256}},
               not_converted=("model.layers.0.mlp.gate", "model.layers.1.mlp.gate"), tp=4, refined=(2, 2)),
)


@dataclass(frozen=True)
class Run:
    name: str
    checkpoint: Checkpoint
    expert_parallel: bool


RUNS = tuple(Run(f"{c.name}-{'ep' if ep else 'tp'}{c.tp}", c, ep) for c in CHECKPOINTS
             for ep in ((False, True) if c.expert_parallel else (False,)))


def _case(checkpoint: Checkpoint) -> str:
    case = {k: v for k, v in checkpoint.config.items() if k != "family"}
    if checkpoint.family:
        case["family"] = checkpoint.family
    case["fp8"] = {"block": BLOCK, "not_converted": list(checkpoint.not_converted), "routers": checkpoint.routers}
    return json.dumps(case)


@pytest.fixture(scope="module")
def fp8_states(vllm_python: str, hf_checkpoints, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("vllm-fp8")
    env = {**os.environ, **CPU_ENGINE_ENV}
    originals = hf_checkpoints.ensure([_case(c) for c in CHECKPOINTS])  # one hf_generate process for all
    specs, artifacts = [], {}
    for run in RUNS:
        original = originals[_case(run.checkpoint)]
        artifact = root / run.name
        tp = run.checkpoint.tp
        ShardJob.prepare(original, artifact, tp=tp, moe=MoeTarget(expert_parallel=run.expert_parallel)).run()
        artifacts[run.name] = artifact
        specs.append({"name": run.name, "tp": tp, "original": str(original), "artifact": str(artifact),
                      "expert_parallel": run.expert_parallel})
    results = {}
    for tp in sorted({spec["tp"] for spec in specs}):  # the workers of one process join one group
        same = [spec for spec in specs if spec["tp"] == tp]
        results.update((r["name"], r) for r in run_engines(vllm_python, STATE, same, env=env, cwd=root, timeout=1800))
    for name, artifact in artifacts.items():
        results[name]["manifest"] = read_manifest(artifact).extra
    return results


@pytest.mark.vllm
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("name", [r.name for r in RUNS])
def test_fp8_rank_files_are_the_state_vllm_builds_in_each_worker(fp8_states, name):
    run = next(r for r in RUNS if r.name == name)
    workers = fp8_states[name]["workers"]
    assert_workers_built_the_same_state(workers, ranks=run.checkpoint.tp)
    for worker in workers:
        default = worker["default"]
        # The comparison covered FP8 weights with their float32 block scales, not a model vLLM left unquantized.
        dtypes = {k: v[1] for k, v in default.items()}
        quantized = [k for k, d in dtypes.items() if d == "float8_e4m3fn"]
        assert quantized and all(dtypes.get(k + "_scale_inv") == "float32" for k in quantized), worker["tp_rank"]
        attention_scales = [k for k in default if k.endswith(".attn.q_scale")]
        assert bool(attention_scales) is not run.checkpoint.family.startswith("deepseek")  # MLA has none
        routers = [k for k in default if k.endswith(("mlp.experts.gate.weight", "block_sparse_moe.gate.weight"))]
        assert all(dtypes[k] == ("float8_e4m3fn" if run.checkpoint.routers else "bfloat16") for k in routers)
        if run.expert_parallel:
            w13 = next(v for k, v in default.items() if k.endswith("w13_weight"))
            assert w13[0][0] == 2, w13  # 4 experts over EP 2
        if run.checkpoint.refined:  # the comparison covered scales on the refined grid: 1/factor of a block
            rows_per_rank = run.checkpoint.config["config"]["moe_intermediate_size"] // run.checkpoint.tp
            w13_scale = next(v for k, v in default.items() if k.endswith("w13_weight_scale_inv"))
            assert w13_scale[0][1] == 2 * rows_per_rank // (BLOCK[0] // run.checkpoint.refined[0]), w13_scale
    quantization = fp8_states[name]["manifest"]["quantization"]
    assert quantization["method"] == "fp8" and quantization["weightBlockSize"] == BLOCK
    refined = run.checkpoint.refined
    assert quantization["moeScaleGrid"] == ({"refinedBlock": [BLOCK[0] // refined[0]] * 2, "factor": list(refined)}
                                            if refined else "checkpoint blocks")
