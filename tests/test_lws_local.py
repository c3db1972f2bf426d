"""The local cluster runs the LeaderWorkerSet controller (e2e/localcluster_lws.py):
a LeaderWorkerSet gets its leader and worker StatefulSets and pods on the real
node. LWS's pod webhook labels the pods and injects LWS_* env vars into their
containers and init containers. The group's worker index can also be read
through the downward API from the pod's label, and Ferry relies on that."""
from __future__ import annotations

import json

import pytest

import localcluster
import localcluster_lws
import localnode
from cluster_support import Kube, wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.node]

LWS = "group"
PREFIX = "leaderworkerset.sigs.k8s.io/"
WORKER_INDEX = PREFIX + "worker-index"
# Prints the injected variables and the worker index read from the pod's label, then waits.
SCRIPT = ('echo "LWS_WORKER_INDEX=$LWS_WORKER_INDEX"; echo "LWS_GROUP_SIZE=$LWS_GROUP_SIZE"; '
          'echo "LWS_LEADER_ADDRESS=$LWS_LEADER_ADDRESS"; echo "INDEX_FROM_LABEL=$INDEX_FROM_LABEL"; exec sleep 3600')


@pytest.fixture
def lws_node(kube: Kube) -> Kube:
    """The cluster with its real node Ready and the LWS CRD served."""
    ready = kube.kubectl("get", "node", localnode.NODE_NAME, "-o",
                         'jsonpath={.status.conditions[?(@.type=="Ready")].status}', check=False).stdout
    assert ready == "True", f"node {localnode.NODE_NAME} is not Ready (FERRY_NODE=0?)"
    assert kube.kubectl("get", "crd", localcluster_lws.CRD, check=False).returncode == 0, \
        "no LeaderWorkerSet CRD: the cluster predates LWS in the harness; run `make cluster-up`"
    return kube


def container(name: str, image: str, script: str) -> dict:
    return {"name": name, "image": image, "imagePullPolicy": "Never", "command": ["/bin/sh", "-c", script],
            "env": [{"name": "INDEX_FROM_LABEL",
                     "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{WORKER_INDEX}']"}}}],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}},
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}}}


def template(role: str, image: str) -> dict:
    return {"metadata": {"labels": {"role": role}},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": localnode.NODE_NAME},
                     "terminationGracePeriodSeconds": 1,
                     "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "runAsNonRoot": True},
                     "initContainers": [container("init", image,
                                                  'echo "INIT LWS_WORKER_INDEX=$LWS_WORKER_INDEX"')],
                     "containers": [container("main", image, SCRIPT)]}}


def env(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def test_a_leaderworkerset_runs_its_group_on_the_real_node(lws_node: Kube, namespace: str, images) -> None:
    kube = lws_node
    busybox = images["busybox"]["ref"]
    kube.apply({"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
                "metadata": {"name": LWS, "namespace": namespace},
                "spec": {"replicas": 1, "leaderWorkerTemplate": {
                    "size": 2, "leaderTemplate": template("leader", busybox),
                    "workerTemplate": template("worker", busybox)}}})
    try:
        def running() -> list[dict] | None:
            pods = kube.get_json("pods", "-n", namespace, "-l", f"{PREFIX}name={LWS}")["items"]
            ok = len(pods) == 2 and all(p["status"].get("phase") == "Running" for p in pods)
            return pods if ok else None

        try:
            pods = {p["metadata"]["name"]: p for p in wait_for(running, "the group's two pods Running", 120)}
        except AssertionError:
            state = kube.kubectl("get", "lws,sts,pods,events", "-n", namespace, "-o", "wide", check=False).stdout
            log = (localcluster.CLUSTER / "logs" / f"{localcluster_lws.PROCESS}.log").read_text()[-3000:]
            raise AssertionError(f"{state}\nlws-controller log:\n{log}")

        # The leader StatefulSet `<lws>` and the worker StatefulSet `<lws>-<group>` the controller made.
        sts = {s["metadata"]["name"]: s for s in kube.get_json("statefulsets", "-n", namespace)["items"]}
        assert set(sts) == {LWS, f"{LWS}-0"}, sorted(sts)
        assert sts[f"{LWS}-0"]["spec"]["replicas"] == 1
        assert set(pods) == {f"{LWS}-0", f"{LWS}-0-1"}, sorted(pods)
        leader, worker = pods[f"{LWS}-0"], pods[f"{LWS}-0-1"]
        for pod, index, role in ((leader, "0", "leader"), (worker, "1", "worker")):
            name, labels = pod["metadata"]["name"], pod["metadata"]["labels"]
            assert pod["spec"]["nodeName"] == localnode.NODE_NAME, name
            assert labels["role"] == role, labels
            assert labels[WORKER_INDEX] == index, labels
            assert labels[PREFIX + "group-index"] == "0", labels  # added by the pod webhook
            assert labels.get(PREFIX + "group-key"), labels
            # The webhook's env vars, in the container spec (the StatefulSet templates have none).
            main = env(pod["spec"]["containers"][0])
            assert main["LWS_WORKER_INDEX"] == index, main
            assert main["LWS_GROUP_SIZE"] == "2", main
            assert main["LWS_LEADER_ADDRESS"] == f"{LWS}-0.{LWS}.{namespace}", main
            assert env(pod["spec"]["initContainers"][0])["LWS_WORKER_INDEX"] == index, pod["spec"]["initContainers"]

            # What the processes saw: the injected vars and the label through the downward API.
            def logged(pod_name: str = name) -> str | None:
                out = kube.kubectl("logs", pod_name, "-n", namespace, "-c", "main", check=False).stdout
                return out if "INDEX_FROM_LABEL=" in out else None

            out = wait_for(logged, f"{name}'s output", 30).splitlines()
            assert f"INDEX_FROM_LABEL={index}" in out, out
            assert f"LWS_WORKER_INDEX={index}" in out, out
            assert "LWS_GROUP_SIZE=2" in out, out
            init = kube.kubectl("logs", name, "-n", namespace, "-c", "init").stdout.splitlines()
            assert f"INIT LWS_WORKER_INDEX={index}" in init, init
        for template_spec in (sts[LWS], sts[f"{LWS}-0"]):
            for c in template_spec["spec"]["template"]["spec"]["containers"]:
                assert "LWS_WORKER_INDEX" not in env(c), json.dumps(c)
    finally:
        kube.kubectl("delete", "namespace", namespace, "--timeout=120s", check=False, timeout=150)
