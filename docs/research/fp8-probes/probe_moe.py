"""Fp8MoEMethod.create_weights shapes for a fake MoE TP size, bypassing the
backend oracle (its __init__ selects a kernel, which needs AMX on CPU)."""
import sys, types, unittest.mock as um
import torch
import vllm.model_executor.layers.quantization.fp8 as fp8
from vllm.model_executor.layers.fused_moe.oracle.fp8 import refine_fp8_moe_block_shape
TP, E, H, I = (int(x) for x in sys.argv[1:5])
um.patch.object(fp8, "get_tensor_model_parallel_world_size", lambda: TP).start()
import vllm.model_executor.layers.quantization.utils.fp8_utils as fu, vllm.distributed as dist
um.patch.object(dist, "get_tensor_model_parallel_world_size", lambda: TP).start()
ip = I // TP
moe = types.SimpleNamespace(intermediate_size_per_partition=ip, tp_size=TP, hidden_dim=H, w13_num_shards=2, has_bias=False)
refined = refine_fp8_moe_block_shape(moe, [128, 128])
fake = types.SimpleNamespace(block_quant=True, weight_block_size=[128, 128], moe=moe,
                             moe_block_shape=refined or [128, 128],
                             weight_scale_refine=None if refined is None else (128 // refined[0], 128 // refined[1]),
                             weight_scale_name="weight_scale_inv",
                             quant_config=types.SimpleNamespace(activation_scheme="dynamic"))
layer = torch.nn.Module()
try:
    with torch.device("meta"):
        fp8.Fp8MoEMethod.create_weights(fake, layer, E, H, ip, torch.bfloat16)
    print(f"tp{TP} E{E} H{H} I{I} refined={refined}:",
          {k: (str(v.dtype).replace('torch.', ''), tuple(v.shape)) for k, v in layer.state_dict().items()})
except Exception as e:
    print(f"tp{TP} E{E} H{H} I{I} refined={refined}: RAISES {type(e).__name__}: {e}")
