#!/usr/bin/env python3
"""`make demo`: Ferry's main job on the embedded default — a real local control
plane (etcd + kube-apiserver + controllers + kwok) and the operator with the
local executor, on this machine.

1. start the control plane, install the CRD generated from the API types;
2. generate a small Llama-3-shaped checkpoint (no model hub is needed);
3. create a vLLM Deployment (kwok runs its pods) and a ModelWeights asking for
   sharded_state at tensor-parallel 2 for it;
4. the operator fetches (vLLM's file rules, verified, manifest last), pre-shards
   per rank on the CPU, and wires the Deployment: flags, read-only mount,
   digest annotation, rollout; you watch `kubectl get mw` until Ready;
5. `ferry verify` re-checks the artifact; a bad spec is refused at admission.

The operator keeps running in the background afterwards (pid and log under
.ferry/), so `kubectl edit mw/tiny-llama -n ferry-demo` makes Ferry prepare
the new artifact and roll the Deployment; `make cluster-down` stops it all.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e"))
# checkpoints.py: real architectures' config.json and tensor names, random
# weights, a real tokenizer (also what the tests generate).
import localcluster  # noqa: E402
from checkpoints import ModelCase, _llama_like, write_checkpoint  # noqa: E402

# Llama-3 shaped (GQA 8:2 heads, untied), small enough to prepare in seconds: ~120 MB of bf16.
DEMO_LLAMA = ModelCase("demo-llama", _llama_like(
    "LlamaForCausalLM", "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, vocab_size=32000), "BF16", files=2)

DEMO = localcluster.STATE / "demo"
OPERATOR_PID = localcluster.STATE / "operator.pid"
OPERATOR_LOG = localcluster.STATE / "operator.log"
NAMESPACE = "ferry-demo"
# The chart's admission policies, applied under a release name of their own
# (the tests helm-install release "ferry" into a cluster the demo left running).
DEMO_RELEASE = "ferry-demo"
BIN = Path(sys.executable).parent


def start_operator() -> int:
    """`ferry-operator run` in the background, its pid and log under .ferry/ (`make cluster-down` stops it)."""
    policies = localcluster.apply_admission_policies(DEMO_RELEASE)
    env = {**os.environ, "KUBECONFIG": str(localcluster.KUBECONFIG), "FERRY_EXECUTOR": "local",
           "FERRY_ADMISSION_POLICIES": policies,
           "FERRY_LOCAL_ROOT": str(DEMO / "artifacts"), "PATH": f"{BIN}:{os.environ['PATH']}"}
    with open(OPERATOR_LOG, "ab") as log:
        proc = subprocess.Popen([str(BIN / "ferry-operator"), "run", "--standalone", "--namespace", NAMESPACE],
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    OPERATOR_PID.write_text(str(proc.pid))
    return proc.pid


def stop_operator() -> None:
    localcluster.stop_pid_file(OPERATOR_PID)


def step(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def kubectl(*args: str, input: str | None = None, check: bool = True, quiet: bool = False) -> str:
    cmd = [localcluster.kubectl_path(), "--kubeconfig", str(localcluster.KUBECONFIG), *args]
    if not quiet:
        print("$ kubectl " + " ".join(args), flush=True)
    proc = subprocess.run(cmd, input=input, text=True, capture_output=True)
    if not quiet:
        sys.stdout.write(proc.stdout + proc.stderr)
    if check and proc.returncode:
        raise SystemExit(f"kubectl failed: {proc.stderr}")
    return proc.stdout


def deployment(namespace: str = NAMESPACE) -> dict:
    """A vLLM Deployment; requesting GPUs is what sends its pods to the (kwok) GPU node."""
    labels = {"app": "tiny-llama-vllm"}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "tiny-llama-vllm", "namespace": namespace},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{
                    "name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                    "args": ["--max-model-len", "4096", "--dtype", "bfloat16"],
                    "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}}


def modelweights(source: Path) -> dict:
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": "tiny-llama", "namespace": NAMESPACE},
            "spec": {"source": {"uri": f"file://{source}"},
                     "storage": {"pvc": {"size": "1Gi"}},
                     "format": {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"},
                     "serving": {"deployments": [{"name": "tiny-llama-vllm", "container": "vllm"}]}}}


def watch_until_ready(timeout: float = 300, namespace: str = NAMESPACE, jobs: bool = False) -> dict:
    """Print `kubectl get mw` (and the prepare Jobs) as they change, until Ready."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        row = "  " + kubectl("get", "mw", "tiny-llama", "-n", namespace, "--no-headers", quiet=True).strip()
        if jobs:
            listed = kubectl("get", "jobs", "-n", namespace, "--no-headers", quiet=True, check=False)
            row += "".join(f"\n    job: {j}" for j in listed.splitlines() if j.strip())
        if row != last:
            print(row, flush=True)
            last = row
        status = json.loads(kubectl("get", "mw", "tiny-llama", "-n", namespace, "-o", "json", quiet=True)).get("status", {})
        conds = {c["type"]: c for c in status.get("conditions", [])}
        if conds.get("Ready", {}).get("status") == "True":
            return status
        if conds.get("Stalled", {}).get("status") == "True":
            raise SystemExit(f"stalled: {conds['Stalled']['reason']}: {conds['Stalled']['message']}")
        time.sleep(0.5)
    reconciling = conds.get("Reconciling", {})
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for Ready: {reconciling.get('reason')}: "
                     f"{reconciling.get('message')}")


def main() -> None:
    step("Local control plane (built from the Go module proxy, cached by version)")
    localcluster.Cluster().up()
    step("Install the ModelWeights CRD generated from the API types")
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(REPO / "crds/ferry.dev_modelweights.yaml"))
    localcluster.wait_crd_established("modelweights.ferry.dev")
    kubectl("create", "namespace", NAMESPACE, check=False, quiet=True)

    step("A small Llama-3-shaped checkpoint (generated: no model hub here)")
    source = DEMO / "checkpoints" / "tiny-llama"
    if not (source / "config.json").exists():
        write_checkpoint(source, DEMO_LLAMA)
    for f in sorted(source.iterdir()):
        print(f"  {f.name:40s} {f.stat().st_size:>12,d} bytes")

    step("The operator, with the local executor (prepare steps run as processes here)")
    stop_operator()  # a previous demo's
    kubectl("delete", "mw", "--all", "-n", NAMESPACE, "--wait=false", check=False, quiet=True)
    for mw in json.loads(kubectl("get", "mw", "-n", NAMESPACE, "-o", "json", quiet=True))["items"]:
        # Without an operator nobody lifts kopf's finalizer of a previous demo's object.
        kubectl("patch", "mw", mw["metadata"]["name"], "-n", NAMESPACE, "--type=merge",
                "-p", '{"metadata":{"finalizers":null}}', check=False, quiet=True)
    shutil.rmtree(DEMO / "artifacts", ignore_errors=True)  # every demo prepares from scratch
    pid = start_operator()
    print(f"  ferry-operator run (pid {pid}, log {OPERATOR_LOG}); it keeps running after the demo")

    step("A vLLM Deployment, and ModelWeights: sharded_state, tensor-parallel 2, for it")
    kubectl("apply", "-f", "-", input=json.dumps(deployment()))
    kubectl("apply", "-f", "-", input=json.dumps(modelweights(source)))
    step("Fetch -> verify -> pre-shard per rank -> wire the Deployment (kubectl get mw)")
    status = watch_until_ready()
    print(json.dumps(status["artifact"], indent=2))
    step("What the Deployment now runs")
    dep = json.loads(kubectl("get", "deploy", "tiny-llama-vllm", "-n", NAMESPACE, "-o", "json", quiet=True))
    container = dep["spec"]["template"]["spec"]["containers"][0]
    print("  args:", " ".join(container["args"]))
    print("  mounts:", json.dumps(container["volumeMounts"]))
    print("  annotation:", dep["spec"]["template"]["metadata"]["annotations"])
    kubectl("rollout", "status", "deploy/tiny-llama-vllm", "-n", NAMESPACE, "--timeout=60s")
    step("The artifact: one file set per rank, verified against its manifest")
    artifact = Path(status["artifact"]["uri"].removeprefix("file://"))
    for f in sorted(artifact.iterdir()):
        print(f"  {f.name:45s} {f.stat().st_size:>12,d} bytes")
    subprocess.run([str(BIN / "ferry"), "verify", str(artifact)], check=True)
    step("A bad spec is refused at admission, naming the field")
    bad = modelweights(source)
    bad["metadata"]["name"] = "bad"
    bad["spec"]["format"] = {"type": "tensorizer"}
    cmd = [localcluster.kubectl_path(), "--kubeconfig", str(localcluster.KUBECONFIG), "create", "-f", "-"]
    print("$ kubectl create -f -  # format.type tensorizer without storage.s3")
    refused = subprocess.run(cmd, input=json.dumps(bad), text=True, capture_output=True)
    print(refused.stdout + refused.stderr, end="")
    if refused.returncode == 0 or "spec.storage.s3" not in refused.stderr:
        raise SystemExit("the bad spec was not refused at admission with the field named")
    print(f"\nDone. The cluster and the operator keep running (pid {pid}, log {OPERATOR_LOG}):\n"
          f"  export KUBECONFIG={localcluster.KUBECONFIG}\n"
          f"  kubectl edit mw/tiny-llama -n {NAMESPACE}   # e.g. tensorParallelSize: 4: Ferry re-prepares and rolls\n"
          "Stop everything with `make cluster-down`.")


if __name__ == "__main__":
    main()
