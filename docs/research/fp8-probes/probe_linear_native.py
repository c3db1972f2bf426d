"""Build vLLM 0.32 FP8 block-quantized linear layers for a fake TP rank on CPU
without AMX, to read the per-rank state_dict names/dtypes/shapes."""
import sys, types, unittest.mock as um
import torch
import vllm.model_executor.layers.linear as lin
import vllm.model_executor.layers.quantization.fp8 as fp8
import vllm.distributed as dist
import vllm.distributed.parallel_state as ps
from vllm.config import VllmConfig, ModelConfig, set_current_vllm_config

TP, RANK = int(sys.argv[1]), int(sys.argv[2])

class FakeModelConfig:  # Fp8LinearMethod reads only .dtype
    dtype = torch.bfloat16

def fake_kernel(**kw):  # init_fp8_linear_kernel: the AMX check lives here
    return types.SimpleNamespace(process_weights_after_loading=lambda layer: None)

patches = [
    um.patch.object(lin, "get_tensor_model_parallel_world_size", lambda: TP),
    um.patch.object(lin, "get_tensor_model_parallel_rank", lambda: RANK),
    um.patch.object(dist, "get_tensor_model_parallel_world_size", lambda: TP),  # fp8_utils imports it lazily
    um.patch.object(fp8, "get_tensor_model_parallel_world_size", lambda: TP),
    # (native kernel selection)
    um.patch.object(fp8, "get_current_vllm_config", lambda: types.SimpleNamespace(model_config=FakeModelConfig)),
]
for p in patches: p.start()
# BasevLLMParameter stamps the *global* rank at __init__; update_param_tp_status fixes it.
import vllm.model_executor.parameter as par
um.patch.object(par, "get_tensor_model_parallel_rank", lambda: RANK, create=True).start()
um.patch.object(par, "get_tensor_model_parallel_world_size", lambda: TP, create=True).start()

cfg = fp8.Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128], "fmt": "e4m3"})
H, HEADS, KV, HD, I = 1024, 16, 4, 64, 1536
with set_current_vllm_config(VllmConfig()), torch.device("meta"):
    torch.set_default_dtype(torch.bfloat16)
    mods = {
        "qkv_proj": lin.QKVParallelLinear(H, HD, HEADS, KV, bias=False, quant_config=cfg, prefix="l.qkv_proj"),
        "o_proj": lin.RowParallelLinear(HEADS * HD, H, bias=False, quant_config=cfg, prefix="l.o_proj"),
        "gate_up_proj": lin.MergedColumnParallelLinear(H, [I, I], bias=False, quant_config=cfg, prefix="l.gate_up_proj"),
        "down_proj": lin.RowParallelLinear(I, H, bias=False, quant_config=cfg, prefix="l.down_proj"),
        "q_b_proj": lin.ColumnParallelLinear(512, HEADS * 192, bias=False, quant_config=cfg, prefix="l.q_b_proj"),
        "fused_qkv_a_proj": lin.MergedColumnParallelLinear(H, [512, 576], bias=False, quant_config=cfg,
                                                            disable_tp=True, prefix="l.fused_qkv_a_proj"),
        "replicated": lin.ReplicatedLinear(H, 64, bias=False, quant_config=cfg, prefix="l.gate"),
    }
for name, m in mods.items():
    for k, v in m.state_dict().items():
        print(f"tp{TP} r{RANK} {name}.{k}: {v.dtype} {tuple(v.shape)} {type(m._parameters.get(k)).__name__} "
              f"mismatch_allowed={m.allow_fp8_block_shape_mismatch}")
