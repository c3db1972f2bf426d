"""Checks that vLLM's reference AWQ packer (quant_utils.awq_pack, which tests/worker/shard/quant_checkpoint.py
uses) writes the same qweight/qzeros bytes as AutoAWQ 0.2.9's WQLinear_GEMM.from_linear. Run once by hand:

    pip install --no-deps --target /tmp/awq autoawq==0.2.9 accelerate
    PYTHONPATH=/tmp/awq $VLLM_VENV/bin/python docs/research/quant-probes/awq_pack_check.py

Measured 2026-12-04: qweight, qzeros and scales equal (int4, group 32, 128 x 256)."""
import torch
from awq.modules.linear.gemm import WQLinear_GEMM
from vllm.model_executor.layers.quantization.utils.quant_utils import awq_pack
torch.manual_seed(0)
out_f, in_f, g = 256, 128, 32
G = in_f // g
q = torch.randint(0, 16, (in_f, out_f), dtype=torch.int32)          # [in, out], AWQ's orientation
z = torch.randint(0, 16, (G, out_f), dtype=torch.int32)
s = (2.0 ** torch.randint(-8, -2, (G, out_f))).half()
w = ((q - z.repeat_interleave(g, 0)).half() * s.repeat_interleave(g, 0))  # exact in fp16
lin = torch.nn.Linear(in_f, out_f, bias=False).half(); lin.weight.data = w.t().contiguous()
ref = WQLinear_GEMM.from_linear(lin, 4, g, scales=s, zeros=z)
print("qweight equal:", torch.equal(ref.qweight, awq_pack(q, 4, in_f, out_f)),
      "qzeros equal:", torch.equal(ref.qzeros, awq_pack(z, 4, G, out_f)), "scales equal:", torch.equal(ref.scales, s))
