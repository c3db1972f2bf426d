"""Serving pods' failures on the real node reach the ModelWeights, naming the
pod and the cause: a serving container that crashes at start (its own error
line, kept by the kubelet as the termination message from the log tail), an
image the node does not have, a pod the scheduler cannot place. Before, all
three read "deployment NAME rolling out; 0/1 replicas loaded" for as long as
they lasted.

The artifact is real (fetched by the chart's operator from the S3 server on
the bridge) and each Deployment is wired by the operator; the serving
process is a busybox stand-in, as in test_loader_on_node.py.
"""
from __future__ import annotations

import json

import pytest

import localcluster
import localnode
from cluster_support import wait_for
from node_support import (NAMESPACE, condition, modelweights, mw_status, pods_of, s3_secret, unique, upload_dir,
                          wait_ready, wait_stalled)

pytestmark = [pytest.mark.cluster, pytest.mark.node]
# vLLM's own start-up failure, as its stand-in prints it, after the loader verified the weights.
CRASHING = """#!/bin/sh
echo "INFO starting vllm $*"
echo "ValueError: Unrecognized load format 'shardedstate'" >&2
exit 1
"""
MISSING_IMAGE = "ferry.local/vllm:not-on-this-node"


def deployment(kube, name: str, *, image: str | None = None, script: str | None = None,
               gpus: int | None = None, cpu: str | None = None, replicas: int = 1) -> None:
    busybox = localcluster.built_images()["busybox"]["ref"]
    labels = {"app": name}
    container = {"name": "vllm", "image": image or busybox, "imagePullPolicy": "Never",
                 "command": ["env", "PATH=/standin:/bin", "vllm", "serve", "tiny-llama"]}
    spec: dict = {"containers": [container]}
    if script is not None:
        kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": f"{name}-vllm", "namespace": NAMESPACE}, "data": {"vllm": script}})
        container["volumeMounts"] = [{"name": "standin", "mountPath": "/standin"}]
        spec["volumes"] = [{"name": "standin", "configMap": {"name": f"{name}-vllm", "defaultMode": 0o755}}]
    if gpus is not None:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    if cpu is not None:
        container["resources"] = {"requests": {"cpu": cpu}}
    kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "progressDeadlineSeconds": 600,
                         "template": {"metadata": {"labels": labels}, "spec": spec}}})


def wired_modelweights(kube, s3, checkpoint, name: str, **serving) -> None:
    upload_dir(s3, name, "tiny-llama", checkpoint)
    s3_secret(kube, NAMESPACE, f"{name}-s3", s3)
    mw = modelweights(name, f"s3://{name}/tiny-llama", {"type": "safetensors"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}], **serving}
    kube.apply(mw)


def events_of(kube, name: str) -> list[dict]:
    return kube.get_json("events", "-n", NAMESPACE, "--field-selector",
                         f"involvedObject.kind=ModelWeights,involvedObject.name={name}")["items"]


def current_pod(kube, name: str) -> dict:
    pods = [p for p in kube.get_json("pods", "-n", NAMESPACE, "-l", f"app={name}")["items"]
            if not p["metadata"].get("deletionTimestamp") and p["metadata"].get("annotations", {}).get(
                "ferry.dev/modelweights") == name]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]
    return pods[0]


@pytest.fixture(scope="module")
def failing(node, chart_operator, node_s3, checkpoint) -> dict[str, str]:
    """Three wired Deployments at once, each failing its own way."""
    names = {"crash": unique("crash"), "image": unique("noimage"), "gpus": unique("nogpu")}
    deployment(node, names["crash"], script=CRASHING)
    deployment(node, names["image"], image=MISSING_IMAGE)
    deployment(node, names["gpus"], gpus=64)  # more than any node has: kwok's GPU node has 8
    for name in names.values():
        wired_modelweights(node, node_s3, checkpoint, name)
    return names


def test_a_crashing_serving_container_stalls_with_its_own_error_line(node, failing):
    name = failing["crash"]
    stalled = wait_stalled(node, NAMESPACE, name, timeout=300)
    pod = current_pod(node, name)
    assert stalled["reason"] == "CrashLoopBackOff", stalled
    assert f"pod {NAMESPACE}/{pod['metadata']['name']} (deployment {name})" in stalled["message"], stalled
    assert "ValueError: Unrecognized load format 'shardedstate'" in stalled["message"], stalled
    # The loader verified the weights first; it is the server that fails.
    (loader,) = pod["status"]["initContainerStatuses"]
    assert loader["state"]["terminated"]["exitCode"] == 0
    # The kubelet kept the log tail because Ferry wired the container with FallbackToLogsOnError.
    (container,) = pod["spec"]["containers"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    status = mw_status(node, NAMESPACE, name)
    assert condition(status, "Ready")["status"] == "False"
    assert any(e["type"] == "Warning" and e["reason"] == "CrashLoopBackOff" and "Unrecognized load format"
               in e["message"] for e in events_of(node, name))

    # Fixed by the user (a server that starts): the stall ends and the ModelWeights becomes Ready.
    node.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-vllm", "namespace": NAMESPACE},
                "data": {"vllm": "#!/bin/sh\nmkdir -p /tmp/www && echo ok > /tmp/www/health\n"
                                 "exec httpd -f -p 8000 -h /tmp/www\n"}})
    node.kubectl("rollout", "restart", f"deployment/{name}", "-n", NAMESPACE)
    ready = wait_ready(node, NAMESPACE, name, timeout=300, stalled_ok=True)
    assert condition(ready, "Stalled").get("status") != "True"


def test_an_image_the_node_does_not_have_stalls_naming_it(node, failing):
    name = failing["image"]
    stalled = wait_stalled(node, NAMESPACE, name, timeout=300)
    assert stalled["reason"] == "ImageNotFound", stalled
    assert f'image "{MISSING_IMAGE}" of container vllm' in stalled["message"], stalled
    assert f"(deployment {name})" in stalled["message"] and "pull policy is Never" in stalled["message"], stalled
    assert any(e["reason"] == "ImageNotFound" for e in events_of(node, name))


def test_an_unschedulable_serving_pod_is_named_with_the_schedulers_words(node, failing):
    name = failing["gpus"]

    def reconciling():
        c = condition(mw_status(node, NAMESPACE, name), "Reconciling")
        return c if c.get("reason") == "Unschedulable" else None
    found = wait_for(reconciling, f"{name} Reconciling/Unschedulable", 300)
    assert f"(deployment {name}) cannot be scheduled" in found["message"], found
    assert "nvidia.com/gpu" in found["message"], found
    assert "rollout.strategy: InPlace" not in found["message"], found  # its old pod waits too: no room to free
    assert condition(mw_status(node, NAMESPACE, name), "Stalled").get("status") != "True"
    events = [e for e in events_of(node, name) if e["reason"] == "Unschedulable"]
    assert events and events[0]["type"] == "Warning", json.dumps(events_of(node, name))[:2000]


SERVES = ("#!/bin/sh\nmkdir -p /tmp/www && echo ok > /tmp/www/health\n"
          "exec httpd -f -p 8000 -h /tmp/www\n")


def free_millicpu(kube) -> int:
    """The real node's allocatable CPU less what its pods request (a pod's request is the larger of its
    largest init container's and the sum of its containers')."""
    node = kube.get_json("node", localnode.NODE_NAME)

    def milli(q: str | None) -> int:
        q = q or "0"
        return int(q[:-1]) if q.endswith("m") else int(float(q) * 1000)

    def request(spec: dict, key: str) -> int:
        return milli(((spec.get("resources") or {}).get("requests") or {}).get(key))
    used = 0
    for pod in kube.get_json("pods", "-A", "--field-selector", f"spec.nodeName={localnode.NODE_NAME}")["items"]:
        if pod["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        spec = pod["spec"]
        used += max([request(c, "cpu") for c in spec.get("initContainers") or []]
                    + [sum(request(c, "cpu") for c in spec["containers"])])
    return milli(node["status"]["allocatable"]["cpu"]) - used


def test_a_surge_pod_with_no_room_names_in_place_which_then_completes_the_rollout(node, chart_operator, node_s3,
                                                                                   checkpoint):
    """The demo-cluster deadlock on the real node: a Deployment that surges (the default 25%) and asks for
    more than half the node's free CPU. Ferry's rollout makes a surge pod the scheduler cannot place while
    the old pod runs; the status names the fix; the user sets serving.rollout InPlace and the same rollout
    completes, after which the Deployment has its own strategy back."""
    name = unique("room")
    deployment(node, name, script=SERVES, cpu=f"{free_millicpu(node) * 6 // 10}m", replicas=0)  # 1 fits, 2 not
    wired_modelweights(node, node_s3, checkpoint, name)
    wait_ready(node, NAMESPACE, name, timeout=300)  # wired with no pod: Ferry's first rollout surges nothing
    node.kubectl("scale", "deployment", name, "-n", NAMESPACE, "--replicas=1")

    def serving():
        d = node.get_json("deployment", name, "-n", NAMESPACE)["status"]
        return (d.get("availableReplicas") == 1
                and condition(mw_status(node, NAMESPACE, name), "Ready").get("status") == "True")
    wait_for(serving, f"{name} serving one wired pod", 180)
    own = node.get_json("deployment", name, "-n", NAMESPACE)["spec"]["strategy"]
    assert own["rollingUpdate"]["maxSurge"] == "25%", own
    # A rollout Ferry starts: the loader goes (serving.readinessGate false), so the template changes.
    node.kubectl("patch", "modelweights", name, "-n", NAMESPACE, "--type=merge", "-p",
                 json.dumps({"spec": {"serving": {"readinessGate": False}}}))

    def unschedulable():
        c = condition(mw_status(node, NAMESPACE, name), "Reconciling")
        return c if c.get("reason") == "Unschedulable" else None
    stuck = wait_for(unschedulable, f"{name} Reconciling/Unschedulable", 180)
    assert "Insufficient cpu" in stuck["message"], stuck
    assert (f"needs room that 1 old pod(s) of deployment {name} still hold" in stuck["message"]
            and f"spec.serving.rollout.strategy: InPlace in ModelWeights {name}" in stuck["message"]), stuck
    assert len(pods_of(node, name)) == 2  # the old pod serves on; the surge pod waits

    node.kubectl("patch", "modelweights", name, "-n", NAMESPACE, "--type=merge", "-p",
                 json.dumps({"spec": {"serving": {"rollout": {"strategy": "InPlace"}}}}))
    generation = node.get_json("modelweights", name, "-n", NAMESPACE)["metadata"]["generation"]

    def done():
        status = mw_status(node, NAMESPACE, name)
        return status if (status.get("observedGeneration") == generation
                          and condition(status, "Ready").get("status") == "True") else None
    wait_for(done, f"{name} Ready in place", 300)
    after = node.get_json("deployment", name, "-n", NAMESPACE)
    assert after["spec"]["strategy"] == own, after["spec"]["strategy"]
    assert "ferry.dev/rollout-strategy" not in (after["metadata"].get("annotations") or {})
    assert not after["spec"]["template"]["spec"].get("initContainers")  # the rollout that was stuck is done
    reasons = [e["reason"] for e in events_of(node, name)]
    assert "RollingInPlace" in reasons and "RolloutStrategyRestored" in reasons, reasons
