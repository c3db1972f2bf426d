"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python vllm_tensorizer.py '[{"model": DIR, "tp": 2, "dtype": "bfloat16",
                                  "checks": [{"name": ..., "extra_config": {...}}, ...]}, ...]'

For each engine (started on the original checkpoint with the default loader,
so it runs on CPU), in every worker (TP rank): a fresh model loaded by vLLM's
default loader from the original checkpoint, and, for each check, one loaded
by vLLM's own `TensorizerLoader.load_model` from Ferry's artifact, configured
from `--model-loader-extra-config` JSON exactly as `vllm serve` does
(`EngineArgs.create_load_config`). Prints one `RESULT {json}` line per engine:
per worker, whether vLLM took the file for a vLLM-tensorized one, and every
parameter and buffer (persistent or not, shared ones under each name) as
[shape, dtype, sha256 of the bytes, sha256 of the values as float32], or
["meta"] for one left on the meta device.

One patch: vLLM 0.32's `deserialize_tensorizer_model` asks
`torch.accelerator.current_device_index()`, which raises on a machine without
an accelerator; it is made to answer 0 (the device string becomes "cpu:0").
Nothing else of the load path is changed. Both models are taken before
`process_weights_after_loading`, which the tensorizer path skips anyway.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from vllm_engine_exit import shutdown  # noqa: E402

RESULT_PREFIX = "RESULT "
torch.cpu._init_amx()  # see tests/worker/shard/vllm_generate.py: bf16 kernels need AMX state


def _loaded(worker, checks: list) -> dict:
    import copy
    import hashlib

    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.tensorizer import is_vllm_tensorized
    from vllm.model_executor.model_loader.tensorizer_loader import TensorizerLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = worker.vllm_config.model_config

    def fresh(load_config):
        # Attention layers register by name in the compilation config: a copy with an empty registry.
        config = copy.copy(worker.vllm_config)
        config.compilation_config = copy.copy(config.compilation_config)
        config.compilation_config.static_forward_context = {}
        config.load_config = load_config
        return config

    def sha(t) -> str:
        return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()

    def tensors(model) -> dict:
        out = {}
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if t.device.type == "meta":
                out[name] = ["meta"]
                continue
            t = t.detach().cpu().contiguous()
            out[name] = [list(t.shape), str(t.dtype).removeprefix("torch."), sha(t), sha(t.float())]
        return out

    default_config = fresh(LoadConfig(load_format="auto"))
    with set_current_vllm_config(default_config), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        reference = initialize_model(vllm_config=default_config, model_config=model_config)
        get_model_loader(default_config.load_config).load_weights(reference, model_config)

    torch.accelerator.current_device_index = lambda: 0  # the one patch (see the module docstring)
    loaded = {}
    for check in checks:
        load_config = EngineArgs(model=model_config.model, load_format="tensorizer",
                                 model_loader_extra_config=json.loads(json.dumps(check["extra_config"]))
                                 ).create_load_config()
        loader = TensorizerLoader(load_config)
        config = fresh(load_config)
        with set_current_vllm_config(config):
            model = loader.load_model(vllm_config=config, model_config=model_config)
        loaded[check["name"]] = {"vllm_tensorized": bool(is_vllm_tensorized(loader.tensorizer_config)),
                                 "uri": loader.tensorizer_config.tensorizer_uri, "tensors": tensors(model)}
    return {"tp_rank": get_tensor_model_parallel_rank(), "default": tensors(reference), "loaded": loaded}


def run(spec: dict) -> list:
    from vllm import LLM

    llm = LLM(model=spec["model"], tensor_parallel_size=spec["tp"], dtype=spec["dtype"], max_model_len=256,
              enforce_eager=True, seed=0, enable_expert_parallel=spec.get("enable_expert_parallel", False))
    try:
        return llm.collective_rpc(_loaded, args=(spec["checks"],))
    finally:
        shutdown(llm)



def main() -> None:
    for spec in json.loads(sys.argv[1]):
        print(RESULT_PREFIX + json.dumps(run(spec)), flush=True)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main()
