"""How much of a cold start torch.compile's caches save on a GPU, when they are
copied to another path and handed to a fresh process (issue 31's "compiled
state" artifact, measured with torch alone: the device machines lent here
have no vLLM).

    python bench/compile_cache_gpu.py --out DIR [--runs 2]

A decoder-shaped block (RMSNorm, attention via SDPA, SwiGLU MLP; hidden 4096,
bf16) is compiled by a fresh process per measurement, with
TORCHINDUCTOR_CACHE_DIR (Inductor's FX graph and autotuning caches, Triton's
kernels beneath it) pointing at:

- cold: an empty directory;
- warm: a copy, at another path, of the directory a cold run filled.

Each child reports the seconds from the first call to its result (compile
plus one step) and the second call's (steady state). Modes: Inductor's
default, and max-autotune-no-cudagraphs (GEMM autotuning, what makes a GPU
compile long). Prints and writes RESULT JSON: per mode, medians of cold and
warm, their ratio, and the cache's size and file count.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time, torch
mode = sys.argv[1]
torch.manual_seed(0)
H, heads, inter, tokens = 4096, 32, 14336, 512

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = torch.nn.RMSNorm(H), torch.nn.RMSNorm(H)
        self.qkv, self.o = torch.nn.Linear(H, 3 * H, bias=False), torch.nn.Linear(H, H, bias=False)
        self.gate_up, self.down = torch.nn.Linear(H, 2 * inter, bias=False), torch.nn.Linear(inter, H, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.n1(x)).view(1, tokens, 3, heads, H // heads).unbind(2)
        a = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                             v.transpose(1, 2), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(1, tokens, H))
        g, u = self.gate_up(self.n2(x)).chunk(2, -1)
        return x + self.down(torch.nn.functional.silu(g) * u)

model = Block().cuda().to(torch.bfloat16)
compiled = torch.compile(model, mode=None if mode == "default" else mode)
x = torch.randn(1, tokens, H, device="cuda", dtype=torch.bfloat16)
with torch.no_grad():
    torch.cuda.synchronize(); t = time.perf_counter()
    compiled(x); torch.cuda.synchronize(); first = time.perf_counter() - t
    t = time.perf_counter(); compiled(x); torch.cuda.synchronize(); second = time.perf_counter() - t
print("CHILD " + json.dumps({"first": first, "second": second, "device": torch.cuda.get_device_name(),
                             "capability": list(torch.cuda.get_device_capability()),
                             "torch": torch.__version__}), flush=True)
"""


def child(mode: str, cache: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True,
                          timeout=400)
    wall = time.perf_counter() - start
    line = next((l for l in proc.stdout.splitlines() if l.startswith("CHILD ")), None)
    if line is None:
        raise SystemExit(f"child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {**json.loads(line[6:]), "process": wall}


def size(directory: Path) -> tuple[int, int]:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--modes", default="default,max-autotune-no-cudagraphs")
    args = ap.parse_args()
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            cold, warm, cache_size = [], [], (0, 0)
            for run in range(args.runs):
                filled = Path(tmp, f"{mode}-cold-{run}")
                cold.append(child(mode, filled))
                restored = Path(tmp, f"{mode}-restored-{run}")  # another path: as a restored artifact would be
                shutil.copytree(filled, restored)
                warm.append(child(mode, restored))
                cache_size = size(filled)
            med = {k: {f: statistics.median(r[f] for r in runs) for f in ("first", "second", "process")}
                   for k, runs in (("cold", cold), ("warm", warm))}
            report[mode] = {"median": med, "firstCallColdOverWarm": med["cold"]["first"] / med["warm"]["first"],
                            "cacheBytes": cache_size[0], "cacheFiles": cache_size[1], "runs": {"cold": cold,
                                                                                             "warm": warm}}
            print(mode, json.dumps(med), flush=True)
            report["device"] = cold[0]["device"]
            args.out.mkdir(parents=True, exist_ok=True)  # after each mode: a timeout keeps what was measured
            (args.out / "compile_cache_gpu.json").write_text(json.dumps(report, indent=2))
    print("RESULT " + json.dumps({m: r["firstCallColdOverWarm"] for m, r in report.items() if m != "device"}))


if __name__ == "__main__":
    main()
