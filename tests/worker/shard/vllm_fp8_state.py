"""Run by the vLLM venv's python (e2e/vllm/install.sh), not by pytest.

    python vllm_fp8_state.py '[{"name": ..., "tp": 2, "original": DIR, "artifact": DIR,
                                "expert_parallel": false}, ...]'   (one TP size for all runs)

The per-rank state vLLM 0.32 itself builds for FP8 block-scaled checkpoints,
without an engine: vLLM's CPU FP8 kernels need AMX, which CI machines may
lack, and a whole engine would also run process_weights_after_loading (which
repacks the FP8 weights out of the state_dict) and a forward pass.

`tp` worker processes join a gloo group through vLLM's own
init_distributed_environment / ensure_model_parallel_initialized. For each
run, each worker builds the model twice with vLLM's model classes and
quantization config, and loads it with vLLM's loaders:

- "default": vLLM's default loader from the original checkpoint (vLLM's own
  weight loaders cut every weight and scale for the rank);
- "sharded": ShardedStateLoader from Ferry's artifact (raises on a missing
  or unexpected key), under the config vLLM builds from the artifact's own
  directory (GPTQ's config reads the directory's tensor names);

and reports ShardedStateLoader's filtered state_dict of each as key ->
[shape, dtype, sha256 of the bytes], before process_weights_after_loading.

Four stand-ins, all kernel choices that raise on CPUs without AMX and are
stored on the quant method, not in the state_dict (nothing here runs a
kernel): `init_fp8_linear_kernel`, which picks the matmul kernel a quantized
Linear will run, returns a placeholder; `select_wna16_moe_backend`, which
picks compressed-tensors int4 experts' kernel, names vLLM's CPU backend (its
CPUExpertsInt4 needs AMX), or Marlin for per-channel scales (the backends
that take them; the non-Marlin ones assert group scales);
`select_int8_moe_backend` (INT8 W8A8 experts) names the CPU backend, and
AWQ and GPTQ experts' (`auto_awq`, `auto_gptq`) names Marlin, the method the
layout is vLLM's for. The
parameters those MoE methods register do not depend on the backend: the
conversion to a kernel's layout is post-load processing.

Prints one line `RESULT {json}` per run: {"name", "workers": [{"tp_rank",
"ep_rank", "default", "sharded"}, ...]}.
"""
import json
import os
import sys
import tempfile
import types
from pathlib import Path

RESULT_PREFIX = "RESULT "


def _digests(state: dict) -> dict:
    import hashlib

    import torch

    return {key: [list(t.shape), str(t.dtype).removeprefix("torch."),
                  hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()]
            for key, t in state.items()}


def _loaded(vllm_config, model_dir: str, load_format: str) -> dict:
    import copy

    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    # Attention and MoE layers register by name in the compilation config: each
    # model is built against a copy with an empty registry.
    vllm_config = copy.copy(vllm_config)
    vllm_config.compilation_config = copy.copy(vllm_config.compilation_config)
    vllm_config.compilation_config.static_forward_context = {}
    model_config = copy.copy(vllm_config.model_config)
    model_config.model = model_dir
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = initialize_model(vllm_config=vllm_config, model_config=model_config)
        get_model_loader(LoadConfig(load_format=load_format)).load_weights(model, model_config)
    return _digests(ShardedStateLoader._filter_subtensors(model.state_dict()))


def _config(run: dict, tp: int, model: str | None = None, load_format: str = "auto"):
    from vllm.config import LoadConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(model=model or run["original"], dtype="bfloat16", max_model_len=256,
                               enforce_eager=True)
    parallel = ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=run.get("expert_parallel", False))
    return VllmConfig(model_config=model_config, parallel_config=parallel,
                      load_config=LoadConfig(load_format=load_format))


def worker(rank: int, tp: int, port: int, runs: list, out_dir: str) -> None:
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import get_ep_group, get_tensor_model_parallel_rank

    fp8.init_fp8_linear_kernel = lambda **kwargs: types.SimpleNamespace(placeholder_for="init_fp8_linear_kernel")
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16 \
        as ct_moe
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    ct_moe.select_wna16_moe_backend = lambda **kwargs: (
        WNA16MoEBackend.MARLIN if kwargs["quant_config"].strategy == "channel" else WNA16MoEBackend.CPU, None)
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8 \
        as ct_int8_moe
    from vllm.model_executor.layers.fused_moe.oracle.int8 import Int8MoeBackend

    ct_int8_moe.select_int8_moe_backend = lambda **kwargs: (Int8MoeBackend.CPU, None)
    import vllm.model_executor.layers.quantization.auto_awq as auto_awq
    import vllm.model_executor.layers.quantization.auto_gptq as auto_gptq

    auto_awq.select_wna16_moe_backend = lambda *args, **kwargs: (WNA16MoEBackend.MARLIN, None)
    auto_gptq.select_wna16_moe_backend = auto_awq.select_wna16_moe_backend
    # No model in the config: vLLM then creates the expert-parallel group too
    # (only MoE models need it; one set of groups serves every run).
    with set_current_vllm_config(VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=tp))):
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        ensure_model_parallel_initialized(tp, 1)
    results = []
    for run in runs:
        config = _config(run, tp)
        try:
            ep_rank = get_ep_group().rank_in_group
        except AssertionError:
            ep_rank = None
        # Each load under the config vLLM builds from that directory, as an engine started on it would: a
        # quantization config reads the model directory too (GPTQ's maybe_update_config globs its files).
        results.append({"tp_rank": get_tensor_model_parallel_rank(), "ep_rank": ep_rank,
                        "default": _loaded(config, run["original"], "auto"),
                        "sharded": _loaded(_config(run, tp, run["artifact"], "sharded_state"), run["artifact"],
                                           "sharded_state")})
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    import torch.multiprocessing as mp

    runs = json.loads(sys.argv[1])
    tp = runs[0]["tp"]
    if any(run["tp"] != tp for run in runs):
        sys.exit("one tensor-parallel size per process: the workers join one group")
    os.environ.setdefault("VLLM_DIST_IDENT", f"ferry-fp8-{os.getpid()}")  # vLLM's CPU shared-memory group name
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(tp, _free_port(), runs, out_dir), nprocs=tp)
        per_rank = [json.loads(Path(out_dir, f"rank-{r}.json").read_text()) for r in range(tp)]
    for index, run in enumerate(runs):
        print(RESULT_PREFIX + json.dumps({"name": run["name"], "workers": [w[index] for w in per_rank]}), flush=True)


if __name__ == "__main__":  # the spawned workers re-import this module
    main()
