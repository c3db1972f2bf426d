"""The serving side on the real node: Ferry's loader in a serving pod's init
container, the readiness gate evaluated by a real kubelet, WeightsLoaded on the
ModelWeights.

The serving process is a stand-in (busybox's httpd answering /health on
vLLM's port, started by a `vllm` script, so Ferry wires its command line as it
wires vLLM's); the loader, the gate, the probe, the token and the admission
policy are the real ones, from the chart's operator in a pod.
"""
from __future__ import annotations

import json
from datetime import datetime

import pytest

import localcluster
import localnode
from cluster_support import wait_for
from node_support import (NAMESPACE, claim_dir, condition, modelweights, mw_status, pods_of, s3_secret,
                          standin_deployment, unique, upload_dir, wait_ready)

pytestmark = [pytest.mark.cluster, pytest.mark.node]
GATE = "ferry.dev/weights-loaded"
def pod_condition(pod: dict, kind: str) -> dict:
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == kind), {})


def when(c: dict) -> datetime:
    return datetime.fromisoformat(c["lastTransitionTime"].replace("Z", "+00:00"))


def loader_patches(pod: str) -> list[dict]:
    """Audit events of pods/status patches of `pod` sent from a pod address with a service account token."""
    import ipaddress

    pods = ipaddress.ip_network(localnode.POD_CIDR)
    return [e for e in localcluster.audit_events()
            if e.get("objectRef", {}).get("resource") == "pods" and e["objectRef"].get("subresource") == "status"
            and e["objectRef"].get("name") == pod
            and any(ipaddress.ip_address(ip) in pods for ip in e.get("sourceIPs", []))]


def test_ready_only_once_the_loader_verified_the_weights(node, chart_operator, node_s3, checkpoint):
    name = unique("loaded")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    standin_deployment(node, name)
    mw = modelweights(name, f"s3://{name}/tiny-llama",
                      {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}]}
    node.apply(mw)
    status = wait_ready(node, NAMESPACE, name, timeout=360)
    digest = status["artifact"]["manifestDigest"]

    # The wiring: init container, gate, /health probe, the pod-bound token in the loader only.
    template = node.get_json("deployment", name, "-n", NAMESPACE)["spec"]["template"]["spec"]
    (init,) = template["initContainers"]
    assert init["name"] == "ferry-load" and init["args"] == ["load", "--artifact", "/ferry/weights",
                                                             "--expected-digest", digest]
    assert template["readinessGates"] == [{"conditionType": GATE}]
    assert template["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8000,
                                                                      "scheme": "HTTP"}

    (pod,) = [p for p in pods_of(node, name) if not p["metadata"].get("deletionTimestamp")]
    assert pod["spec"]["nodeName"] == localnode.NODE_NAME
    (loader,) = pod["status"]["initContainerStatuses"]
    assert loader["state"]["terminated"]["exitCode"] == 0 and loader["containerID"].startswith("containerd://")
    gate = pod_condition(pod, GATE)
    assert gate["status"] == "True" and gate["reason"] == "Loaded", gate
    assert digest in gate["message"] and "rank 0,1" in gate["message"], gate
    ready = pod_condition(pod, "Ready")
    assert ready["status"] == "True" and when(ready) >= when(gate)
    # Set by the loader itself: the pod's own token, from the pod's address.
    patches = loader_patches(pod["metadata"]["name"])
    assert any(e["user"]["username"] == f"system:serviceaccount:{NAMESPACE}:default"
               and e["user"]["extra"]["authentication.kubernetes.io/pod-name"] == [pod["metadata"]["name"]]
               and e["responseStatus"]["code"] == 200 for e in patches), patches

    # The ModelWeights aggregates it; `kubectl get mw` shows it.
    loaded = condition(status, "WeightsLoaded")
    assert loaded["status"] == "True" and loaded["message"].startswith("1/1 replicas loaded"), loaded
    assert status["loaded"]["summary"] == "1/1" and status["loaded"]["p50LoadSeconds"] >= 0
    row = node.kubectl("get", "mw", name, "-n", NAMESPACE).stdout.splitlines()
    header, values = row[0].split(), row[1].split()
    assert values[header.index("LOADED")] == "1/1"

    # The real kubelet honours the gate: the condition False makes the pod NotReady, True Ready again.
    pod_name = pod["metadata"]["name"]
    for value, ready_after in (("False", "False"), ("True", "True")):
        node.kubectl("patch", "pod", pod_name, "-n", NAMESPACE, "--subresource=status", "--type=strategic", "-p",
                     json.dumps({"status": {"conditions": [{"type": GATE, "status": value, "reason": "Test"}]}}))
        wait_for(lambda: pod_condition(node.get_json("pod", pod_name, "-n", NAMESPACE), "Ready")["status"]
                 == ready_after, f"pod Ready={ready_after} after the gate turned {value}")

    # A corrupt rank file: the next pod's loader fails naming it, never starts the server, and the rollout stalls.
    claim, _, path = status["artifact"]["uri"].removeprefix("pvc://").partition("/")
    victim = claim_dir(node, claim) / path / "model-rank-1-part-0.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    node.kubectl("rollout", "restart", f"deployment/{name}", "-n", NAMESPACE)

    def failed_pod():
        for p in pods_of(node, name):
            c = pod_condition(p, GATE)
            if p["metadata"]["name"] != pod_name and c.get("status") == "False" and c.get("reason") == \
                    "VerificationFailed":
                return p
    bad = wait_for(failed_pod, "the new pod's loader to report the corrupt file", timeout=180)
    assert "model-rank-1-part-0.safetensors" in pod_condition(bad, GATE)["message"]
    assert pod_condition(bad, "Ready")["status"] == "False"
    assert not bad["status"]["containerStatuses"][0].get("state", {}).get("running")  # the server never started

    def stalled():
        s = mw_status(node, NAMESPACE, name)
        c = condition(s, "WeightsLoaded")
        return s if c.get("status") == "False" and "model-rank-1-part-0.safetensors" in c.get("message", "") else None
    s = wait_for(stalled, "WeightsLoaded False naming the file", timeout=60)
    assert condition(s, "WeightsLoaded")["reason"] == "VerificationFailed"
    assert condition(s, "Ready")["status"] == "False" and condition(s, "Stalled")["status"] == "True"
    dep = node.get_json("deployment", name, "-n", NAMESPACE)
    assert dep["status"].get("updatedReplicas") == 1 and dep["status"].get("replicas") == 2  # not rolled out
    # The old pod, verified before the damage, keeps serving.
    assert pod_condition(node.get_json("pod", pod_name, "-n", NAMESPACE), "Ready")["status"] == "True"
    node.kubectl("delete", "mw", name, "-n", NAMESPACE, "--wait=false")
    node.kubectl("delete", "deployment", name, "-n", NAMESPACE, "--wait=false")
