"""Benchmark: a vLLM pod's start with Ferry's restored compiled state against the same pod compiling, on
the real node (issue 31). Run after `make demo-cluster` (vLLM serving the TP 2 artifact):

    make demo-cluster
    .venv/bin/python bench/compile_cache_node.py [--rounds 3]

It turns on `serving.compiledState.mode: AfterFirstReady` for the demo's ModelWeights and drops the demo
Deployment's `--enforce-eager` (production runs compile), then alternates, one vLLM pod at a time
(replicas 0 -> 1, so no old pod shares the two cores):

- **cold**: the store's entries removed from the claim first, so the pod compiles; its harvest sidecar
  then keeps what it compiled;
- **warm**: the next pod, whose loader restores (and verifies) that state before vLLM starts.

Each time is the pod's creationTimestamp to its Ready condition (Ready: Ferry's loader gate and vLLM's
/health), the same node and page-cache state (every file was read in the round before). Prints per run
the loader's own seconds and vLLM's "torch.compile takes" line, then medians and warm/cold; checks that
every run's greedy completion is the same text. A benchmark: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e"))
import demo_cluster as demo  # noqa: E402
import vllm_pod  # noqa: E402
from demo import kubectl  # noqa: E402

NS, MW, DEPLOY = demo.NAMESPACE, "tiny-llama", demo.DEPLOYMENT


def get(*args: str) -> dict:
    return json.loads(kubectl("get", *args, "-n", NS, "-o", "json", quiet=True))


def store_dir() -> Path:
    """The compiled-state store on the claim, from the host (the local-path provisioner's directory)."""
    mw = get("mw", MW)
    claim, _, path = mw["status"]["artifact"]["uri"].removeprefix("pvc://").partition("/")
    pv = json.loads(kubectl("get", "pv", get("pvc", claim)["spec"]["volumeName"], "-o", "json", quiet=True))
    root = Path((pv["spec"].get("hostPath") or pv["spec"]["local"])["path"])
    return root / "/".join(path.split("/")[:-2]) / "compiled"


def one_pod() -> dict:
    """Scale to 0 and back to 1; the new pod once Ready."""
    kubectl("scale", "deployment", DEPLOY, "-n", NS, "--replicas=0", quiet=True)
    while get("pods", "-l", f"app={DEPLOY}")["items"]:
        time.sleep(1)
    kubectl("scale", "deployment", DEPLOY, "-n", NS, "--replicas=1", quiet=True)
    return demo.wait_serving_pod(timeout=900)


def seconds(pod: dict) -> float:
    created = datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    return (datetime.fromisoformat(ready["lastTransitionTime"].replace("Z", "+00:00")) - created).total_seconds()


def describe(pod: dict) -> tuple[str, str]:
    loaded = next(c.get("message", "") for c in pod["status"]["conditions"] if c["type"] == "ferry.dev/weights-loaded")
    log = kubectl("logs", pod["metadata"]["name"], "-n", NS, "-c", "vllm", quiet=True, check=False)
    compile_line = next((line.split("]", 1)[-1].strip() for line in log.splitlines()
                         if "torch.compile takes" in line or "compilation" in line.lower() and "took" in line), "-")
    outcome = loaded.split("; ")[-1] if "compiled state" in loaded else "-"
    return outcome[:110], compile_line[:110]


def completion(pod: dict) -> str:
    body = {"model": "tiny-llama", "prompt": "w100 w200 w300", "max_tokens": 8, "temperature": 0.0}
    return vllm_pod.complete(pod["status"]["podIP"], body)["choices"][0]["text"]


def prepare() -> None:
    kubectl("patch", "mw", MW, "-n", NS, "--type=merge", "-p",
            json.dumps({"spec": {"serving": {"compiledState": {"mode": "AfterFirstReady"}}}}), quiet=True)
    dep = get("deployment", DEPLOY)
    (container,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm"]
    if "--enforce-eager" in container["args"]:
        i = container["args"].index("--enforce-eager")
        kubectl("patch", "deployment", DEPLOY, "-n", NS, "--type=json", "-p", json.dumps(
            [{"op": "remove", "path": f"/spec/template/spec/containers/0/args/{i}"}]), quiet=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:  # wired with the compiled state: the loader carries the key
        inits = get("deployment", DEPLOY)["spec"]["template"]["spec"].get("initContainers", [])
        if any(c["name"] == "ferry-compiled-harvest" for c in inits):
            return
        time.sleep(2)
    raise SystemExit("the Deployment was not wired with serving.compiledState within 600 s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the runs here")
    args = ap.parse_args()
    prepare()
    runs: list[dict] = []
    for n in range(args.rounds):
        for kind in ("cold", "warm"):
            if kind == "cold":
                shutil.rmtree(store_dir(), ignore_errors=True)
            pod = one_pod()
            took = seconds(pod)
            outcome, compiled = describe(pod)
            runs.append({"round": n, "kind": kind, "seconds": took, "text": completion(pod),
                         "loader": outcome, "vllm": compiled})
            print(f"round {n} {kind:4s} {took:6.1f} s  loader: {outcome}  vllm: {compiled}", flush=True)
            if kind == "cold":  # the next pod restores only once the harvest published
                deadline = time.monotonic() + 300
                while not list(store_dir().glob("*/*/compiled.json")) and time.monotonic() < deadline:
                    time.sleep(1)
    cold = statistics.median(r["seconds"] for r in runs if r["kind"] == "cold")
    warm = statistics.median(r["seconds"] for r in runs if r["kind"] == "warm")
    texts = {r["text"] for r in runs}
    print(f"\npod created -> Ready, medians of {args.rounds}: cold {cold:.1f} s, warm {warm:.1f} s, "
          f"warm/cold {warm / cold:.2f}; greedy completions {'all equal' if len(texts) == 1 else 'DIFFER'}: "
          f"{sorted(texts)!r}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "cold_s": cold, "warm_s": warm, "ratio": warm / cold},
                                        indent=1))
    return 0 if len(texts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
