"""Load random FP8 block checkpoint tensors into vLLM 0.32 layers for a fake TP
rank (CPU, no AMX) through vLLM's own weight loaders, and compare with the
predicted ferry slicing rule. Usage: probe_load.py TP"""
import sys, types, unittest.mock as um, math
import torch
import vllm.model_executor.layers.linear as lin
import vllm.model_executor.layers.quantization.fp8 as fp8
import vllm.distributed as dist
import vllm.model_executor.parameter as par

TP = int(sys.argv[1])
state = {"rank": 0}
def rank(): return state["rank"]
for mod in (lin, par):
    um.patch.object(mod, "get_tensor_model_parallel_rank", rank, create=True).start()
    um.patch.object(mod, "get_tensor_model_parallel_world_size", lambda: TP, create=True).start()
um.patch.object(dist, "get_tensor_model_parallel_world_size", lambda: TP).start()
um.patch.object(fp8, "init_fp8_linear_kernel", lambda **kw: types.SimpleNamespace()).start()
um.patch.object(fp8, "get_current_vllm_config",
                lambda: types.SimpleNamespace(model_config=types.SimpleNamespace(dtype=torch.bfloat16))).start()
torch.set_default_dtype(torch.bfloat16)
B = 128
cfg = fp8.Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [B, B]})
g = torch.Generator().manual_seed(0)
def ckpt(rows, cols):
    w = torch.randn(rows, cols, generator=g).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(rows / B), math.ceil(cols / B), generator=g)
    return w, s
def blk(n): return math.ceil(n / B)

def run(name, build, shards, predict):
    for r in range(TP):
        state["rank"] = r
        try:
            m = build()
            for sid, (w, s) in shards.items():
                for pname, t in (("weight", w), ("weight_scale_inv", s)):
                    p = getattr(m, pname)
                    (p.weight_loader(p, t, sid) if sid is not None else p.weight_loader(p, t))
        except Exception as e:
            print(f"tp{TP} r{r} {name}: vLLM RAISES {type(e).__name__}: {str(e)[:160]}"); continue
        pw, ps_ = predict(r)
        ok = torch.equal(m.weight.view(torch.uint8), pw.view(torch.uint8)) and torch.equal(m.weight_scale_inv, ps_)
        print(f"tp{TP} r{r} {name}: w{tuple(m.weight.shape)} s{tuple(m.weight_scale_inv.shape)} "
              f"matches ferry rule: {ok}")

H, HEADS, KV, HD, I = 1024, 16, int(sys.argv[2]) if len(sys.argv) > 2 else 4, int(sys.argv[3]) if len(sys.argv) > 3 else 64, 1536
q, k, v = ckpt(HEADS * HD, H), ckpt(KV * HD, H), ckpt(KV * HD, H)
def rows(t, start, n): return t[start:start + n]
def qkv_pred(r):
    qp = HEADS * HD // TP
    if TP >= KV: head, kvp = r // (TP // KV), HD
    else: head, kvp = r, KV * HD // TP
    w = torch.cat([rows(q[0], r * qp, qp), rows(k[0], head * kvp, kvp), rows(v[0], head * kvp, kvp)])
    s = torch.cat([rows(q[1], r * blk(qp), blk(qp)), rows(k[1], head * blk(kvp), blk(kvp)), rows(v[1], head * blk(kvp), blk(kvp))])
    return w, s
run("qkv_proj", lambda: lin.QKVParallelLinear(H, HD, HEADS, KV, bias=False, quant_config=cfg, prefix="qkv_proj"),
    {"q": q, "k": k, "v": v}, qkv_pred)
gate, up = ckpt(I, H), ckpt(I, H)
def gu_pred(r):
    ip = I // TP
    return (torch.cat([rows(gate[0], r * ip, ip), rows(up[0], r * ip, ip)]),
            torch.cat([rows(gate[1], r * blk(ip), blk(ip)), rows(up[1], r * blk(ip), blk(ip))]))
run("gate_up_proj", lambda: lin.MergedColumnParallelLinear(H, [I, I], bias=False, quant_config=cfg, prefix="gate_up_proj"),
    {0: gate, 1: up}, gu_pred)
down = ckpt(H, I)
def down_pred(r):
    ip = I // TP
    return down[0][:, r * ip:(r + 1) * ip], down[1][:, r * blk(ip):(r + 1) * blk(ip)]
run("down_proj", lambda: lin.RowParallelLinear(I, H, bias=False, quant_config=cfg, prefix="down_proj"), {None: down}, down_pred)
qa, kva = ckpt(512, H), ckpt(576, H)  # DeepSeek fused_qkv_a_proj: [q_lora | kv_lora+rope], replicated
run("fused_qkv_a_proj", lambda: lin.MergedColumnParallelLinear(H, [512, 576], bias=False, quant_config=cfg,
                                                                 disable_tp=True, prefix="fused_qkv_a_proj"),
    {0: qa, 1: kva}, lambda r: (torch.cat([qa[0], kva[0]]), torch.cat([qa[1], kva[1]])))
