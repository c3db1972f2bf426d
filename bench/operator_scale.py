#!/usr/bin/env python3
"""Benchmark: the operator at scale, local executor, tiny checkpoints.

    .venv/bin/python bench/operator_scale.py [--objects 100] [--idle-seconds 60] [--apply-threads 8] [--interval 2]

Starts its own local cluster (control plane + kwok's GPU nodes, no real node:
FERRY_NODE=0, state in --state, default /tmp/ferry-scale) and one operator
process (`ferry-operator run`, local executor), then applies --objects
ModelWeights at once (--apply-threads client threads, default 8), each a
safetensors copy of the same tiny checkpoint wired to a vLLM Deployment of
its own (one replica, one GPU; an extra kwok node holds them all and their
rolling updates; the controller manager at 200 requests/s, see
FERRY_CONTROLLER_MANAGER_ARGS below). Measures:

- apply -> step started: the first worker's launch record (local executor's
  `.steps/<step>.launches`, written by the runner as it starts) minus the
  client's clock just before its create call;
- apply -> Deployment patched (a watch sees the artifact in its template),
  -> Prepared and -> Ready (a watch on ModelWeights), the worker's own run,
  and its exit -> Ready; per object in the JSON's "timeline";
- the operator's RSS (peak and idle) and CPU seconds (prepare and idle);
- API requests per second while every object is Ready and idle: the
  difference of the API server's own `apiserver_request_total` over
  --idle-seconds, minus the benchmark's own two scrapes.

Reports p50/p99 and writes JSON to --out. A benchmark, not a test: nothing
here asserts a time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds user+sys, RSS bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=100)
    ap.add_argument("--idle-seconds", type=float, default=60)
    ap.add_argument("--apply-threads", type=int, default=8,
                    help="client threads creating the ModelWeights (1: one after another)")
    ap.add_argument("--interval", type=float, default=2.0, help="FERRY_RECONCILE_INTERVAL of the operator")
    ap.add_argument("--state", type=Path, default=Path("/tmp/ferry-scale"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/ferry-scale/result.json"))
    args = ap.parse_args()

    os.environ["FERRY_STATE_DIR"] = str(args.state)
    os.environ["FERRY_NODE"] = "0"
    # The cluster's own rollout throughput, not the operator's, would bound
    # apply -> Ready at client-go's default 20 requests/s of the controllers.
    os.environ.setdefault("FERRY_CONTROLLER_MANAGER_ARGS",
                          "--kube-api-qps=200 --kube-api-burst=400 --concurrent-deployment-syncs=10 "
                          "--concurrent-replicaset-syncs=10")
    sys.path.insert(0, str(REPO / "e2e"))
    import localcluster  # after FERRY_STATE_DIR: it reads it at import
    import numpy as np
    from kubernetes import client, config, watch
    from safetensors.numpy import save_file

    cluster = localcluster.Cluster()
    if cluster.running():
        cluster.down(quiet=True)
    # A fresh start: the control plane's data and the local executor's records
    # of an earlier run would make every step look done already.
    for leftover in ("cluster", "artifacts"):
        shutil.rmtree(args.state / leftover, ignore_errors=True)
    cluster.up()
    kubeconfig = str(localcluster.KUBECONFIG)
    kubectl = [localcluster.kubectl_path(), "--kubeconfig", kubeconfig]
    subprocess.run([*kubectl, "apply", "--server-side", "-f", str(REPO / "crds/ferry.dev_modelweights.yaml")],
                   check=True, capture_output=True)
    localcluster.wait_crd_established("modelweights.ferry.dev", localcluster.KUBECONFIG)
    ns = "scale"
    subprocess.run([*kubectl, "create", "namespace", ns], capture_output=True)
    src = args.state / "checkpoint"
    if not (src / "model.safetensors").exists():
        src.mkdir(parents=True, exist_ok=True)
        save_file({"model.embed_tokens.weight": np.ones((64, 16), dtype=np.float32)}, str(src / "model.safetensors"))
        (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    root = args.state / "artifacts"
    env = {**os.environ, "KUBECONFIG": kubeconfig, "FERRY_EXECUTOR": "local", "FERRY_LOCAL_ROOT": str(root),
           "FERRY_ADMISSION_POLICIES": localcluster.apply_admission_policies("ferry-scale", Path(kubeconfig)),
           "FERRY_RECONCILE_INTERVAL": str(args.interval), "PATH": f"{BIN}:{os.environ['PATH']}"}
    log = open(args.state / "operator.log", "ab")
    operator = subprocess.Popen([str(BIN / "ferry-operator"), "run", "--standalone", "--namespace", ns], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    config.load_kube_config(kubeconfig)
    custom, apps = client.CustomObjectsApi(), client.AppsV1Api()
    ready_at: dict[str, float] = {}
    prepared_at: dict[str, float] = {}
    wired_at: dict[str, float] = {}
    done = threading.Event()

    def keep_watching(what: str, list_fn, *list_args, seen) -> None:
        # A watch the API server ends (or that fails) is started again: its
        # initial listing replays the current state, and the first times seen are kept.
        while not done.is_set():
            try:
                for event in watch.Watch().stream(list_fn, *list_args, timeout_seconds=300):
                    if seen(event["object"]) or done.is_set():
                        return
            except Exception as exc:  # noqa: BLE001 - report and watch again
                print(f"[operator_scale] {what} watch ended ({type(exc).__name__}: {exc}); watching again",
                      file=sys.stderr)
                time.sleep(1)

    def wired(dep) -> bool:
        # When each Deployment's template first carries the artifact (the operator's patch).
        if "ferry.dev/modelweights" in (dep.spec.template.metadata.annotations or {}):
            wired_at.setdefault(dep.metadata.name, time.time())
        return len(wired_at) >= args.objects

    def prepared_and_ready(obj) -> bool:
        conds = {c["type"]: c["status"] for c in (obj.get("status") or {}).get("conditions", [])}
        for cond, at in (("Prepared", prepared_at), ("Ready", ready_at)):
            if conds.get(cond) == "True":
                at.setdefault(obj["metadata"]["name"], time.time())
        return len(ready_at) >= args.objects

    threading.Thread(target=keep_watching, args=("ModelWeights", custom.list_namespaced_custom_object, "ferry.dev",
                                                 "v1alpha1", ns, "modelweights"),
                     kwargs={"seen": prepared_and_ready}, daemon=True).start()
    threading.Thread(target=keep_watching, args=("Deployment", apps.list_namespaced_deployment, ns),
                     kwargs={"seen": wired}, daemon=True).start()
    time.sleep(3)  # the operator's start-up
    applied_at: dict[str, float] = {}
    # Room for every Deployment and its rolling update's surge pod, on one node
    # (kwok renews one node lease, whatever its size).
    cluster._create_fake_node("ferry-scale-node", pods=2 * args.objects + 10, gpus=2 * args.objects + 10)

    def create_deployment(i: int) -> None:
        name = f"mw-{i:04d}"
        labels = {"app": name}
        apps.create_namespaced_deployment(ns, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "args": ["--dtype", "auto"],
                                         "resources": {"limits": {"nvidia.com/gpu": "1"}}}]}}}})

    def apply(i: int) -> None:
        name = f"mw-{i:04d}"
        spec = {"source": {"uri": f"file://{src}"}, "storage": {"pvc": {"size": "1Gi"}}, "format": {"type": "safetensors"},
                "serving": {"deployments": [{"name": name, "container": "vllm"}]}}
        applied_at[name] = time.time()
        custom.create_namespaced_custom_object("ferry.dev", "v1alpha1", ns, "modelweights",
                                               {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
                                                "metadata": {"name": name}, "spec": spec})

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(create_deployment, range(args.objects)))
    # The Deployments' pods settle first: the measurement starts from a serving fleet.
    deadline = time.time() + 600
    while time.time() < deadline:
        ready = sum((d.status.ready_replicas or 0) for d in apps.list_namespaced_deployment(ns).items)
        if ready >= args.objects:
            break
        time.sleep(2)
    cpu0, _ = proc_stats(operator.pid)
    with ThreadPoolExecutor(args.apply_threads) as pool:
        list(pool.map(apply, range(args.objects)))
    peak_rss = 0
    deadline = time.time() + 1800
    while len(ready_at) < args.objects and time.time() < deadline:
        peak_rss = max(peak_rss, proc_stats(operator.pid)[1])
        time.sleep(0.5)
    cpu1, _ = proc_stats(operator.pid)
    started, worker_done = {}, {}
    for name in applied_at:
        launches = list((root / ns / name / ".steps").glob("*.launches"))
        if launches:
            started[name] = min(f.stat().st_mtime for f in launches)
        exits = list((root / ns / name / ".steps").glob("*/rc"))
        if exits:
            worker_done[name] = max(f.stat().st_mtime for f in exits)

    def requests_total() -> float:
        text = subprocess.run([*kubectl, "get", "--raw", "/metrics"], capture_output=True, text=True).stdout
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("apiserver_request_total{"))

    time.sleep(5)  # let the last status patches land
    before = requests_total()
    idle0, _ = proc_stats(operator.pid)
    time.sleep(args.idle_seconds)
    after = requests_total()
    idle1, idle_rss = proc_stats(operator.pid)
    done.set()
    result = {
        "objects": args.objects, "reconcile_interval_s": args.interval, "apply_threads": args.apply_threads, "ready": len(ready_at),
        "apply_to_step_started_s": {"p50": pct([started[n] - applied_at[n] for n in started], 0.5),
                                    "p99": pct([started[n] - applied_at[n] for n in started], 0.99)},
        "apply_to_ready_s": {"p50": pct([ready_at[n] - applied_at[n] for n in ready_at], 0.5),
                             "p99": pct([ready_at[n] - applied_at[n] for n in ready_at], 0.99)},
        "apply_to_prepared_s": {"p50": pct([prepared_at[n] - applied_at[n] for n in prepared_at], 0.5),
                                "p99": pct([prepared_at[n] - applied_at[n] for n in prepared_at], 0.99)},
        # The operator's patch of the Deployment; Ready then waits for the cluster's rollout.
        "apply_to_deployment_patched_s": {"p50": pct([wired_at[n] - applied_at[n] for n in wired_at], 0.5),
                                          "p99": pct([wired_at[n] - applied_at[n] for n in wired_at], 0.99)},
        # Where the time goes: the worker's own run, and its exit until the watch saw Ready.
        "worker_run_s": {"p50": pct([worker_done[n] - started[n] for n in worker_done if n in started], 0.5),
                         "p99": pct([worker_done[n] - started[n] for n in worker_done if n in started], 0.99)},
        "worker_exit_to_ready_s": {"p50": pct([ready_at[n] - worker_done[n] for n in ready_at if n in worker_done], 0.5),
                                   "p99": pct([ready_at[n] - worker_done[n] for n in ready_at if n in worker_done], 0.99)},
        "apply_span_s": round(max(applied_at.values()) - min(applied_at.values()), 1),
        "operator_cpu_s_prepare": round(cpu1 - cpu0, 2),
        "operator_peak_rss_mib": round(peak_rss / 2**20, 1),
        "operator_idle_rss_mib": round(idle_rss / 2**20, 1),
        "operator_idle_cpu_fraction": round((idle1 - idle0) / args.idle_seconds, 3),
        # The benchmark's own scrape (one request) is subtracted.
        "idle_api_requests_per_s": round((after - before - 1) / args.idle_seconds, 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    timeline = {n: {"applied": applied_at[n], "started": started.get(n), "worker_done": worker_done.get(n),
                    "prepared": prepared_at.get(n), "wired": wired_at.get(n), "ready": ready_at.get(n)}
                for n in applied_at}
    args.out.write_text(json.dumps({**result, "timeline": timeline}, indent=2))
    print(json.dumps(result, indent=2))
    operator.terminate()
    try:
        operator.wait(timeout=20)
    except subprocess.TimeoutExpired:
        operator.kill()
    cluster.down(quiet=True)


if __name__ == "__main__":
    main()
