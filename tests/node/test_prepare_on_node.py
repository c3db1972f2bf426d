"""The production path, run for real on the local cluster's real node: the
chart's operator in a pod under its own ServiceAccount, prepare Jobs running
the image built here on dynamically provisioned claims, results and progress
reported from inside the pods. kwok plays only the GPU node (the vLLM pods)."""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from cluster_support import wait_for
from node_support import (HOSTILE_KEYS, NAMESPACE, assert_no_hostile_env, claim_dir, condition, job_pods, modelweights,
                          mw_status, operator_pod, s3_secret, unique, upload_dir, wait_ready)

REPO = Path(__file__).resolve().parents[2]
import localcluster  # noqa: E402
import localnode  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.node]
FERRY = Path(sys.executable).with_name("ferry")


def assert_ran_for_real(kube, name: str, steps: set[str]) -> None:
    pods = job_pods(kube, name)
    assert {p["metadata"]["labels"]["ferry.dev/step"] for p in pods} == steps
    for pod in pods:
        assert pod["spec"]["nodeName"] == localnode.NODE_NAME
        (cs,) = pod["status"]["containerStatuses"]
        term = cs["state"]["terminated"]
        assert term["exitCode"] == 0, term
        assert cs["containerID"].startswith("containerd://")
        # The worker's own result, written to /dev/termination-log by uid 65532.
        assert json.loads(term["message"])["manifestDigest"].startswith("sha256:")


def worker_requests(name: str) -> list[dict]:
    """The API server's audit events of writes made with the worker's
    ServiceAccount token from a pod address, for this ModelWeights' steps."""
    import ipaddress

    pods = ipaddress.ip_network(localnode.POD_CIDR)
    return [e for e in localcluster.audit_events()
            if e["user"]["username"] == f"system:serviceaccount:{NAMESPACE}:ferry-worker"
            and (e.get("objectRef", {}).get("name") or "").startswith(name)
            and any(ipaddress.ip_address(ip) in pods for ip in e.get("sourceIPs", []))]


def progress_reported_on_own_pod(events: list[dict]) -> list[dict]:
    """Progress reports: the condition ferry.dev/progress patched onto the worker's own pod, and admitted."""
    reports = []
    for e in events:
        if e["objectRef"].get("resource") != "pods" or e["objectRef"].get("subresource") != "status":
            continue
        if e.get("responseStatus", {}).get("code") != 200:
            continue
        pod = e.get("user", {}).get("extra", {}).get("authentication.kubernetes.io/pod-name", [None])[0]
        for c in (e.get("requestObject") or {}).get("status", {}).get("conditions", []):
            if c.get("type") == "ferry.dev/progress" and pod == e["objectRef"]["name"]:
                reports.append(json.loads(c["message"]))
    return reports


def test_the_node_is_real(node):
    wide = node.kubectl("get", "nodes", "-o", "wide").stdout
    row = next(line for line in wide.splitlines() if line.startswith(localnode.NODE_NAME))
    assert "containerd://1." in row and " Ready " in row
    for name in localcluster.FAKE_NODES:
        kwok = node.get_json("node", name)
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in kwok["spec"]["taints"]
    # The kubelet registered under its own node identity: the Node authorizer
    # lets it read only what its pods need.
    assert node.kubectl("auth", "can-i", "list", "secrets", "-A", "--as", f"system:node:{localnode.NODE_NAME}",
                        "--as-group", "system:nodes", check=False).stdout.startswith("no")


def test_operator_runs_in_a_pod_under_the_charts_service_account(node, chart_operator):
    pod = operator_pod(node, chart_operator["namespace"])
    assert pod["spec"]["nodeName"] == localnode.NODE_NAME
    assert pod["spec"]["serviceAccountName"] == chart_operator["service_account"]
    (cs,) = pod["status"]["containerStatuses"]
    assert cs["ready"] and cs["image"].startswith("ferry.local/ferry")
    c = pod["spec"]["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    # It reached the API server through the `kubernetes` Service (kube-proxy) with its own token:
    # kopf's startup is in its log.
    logs = node.kubectl("logs", "-n", chart_operator["namespace"], pod["metadata"]["name"]).stdout
    assert "kopf" in logs.lower(), logs[-2000:]
    # Watching a named namespace it never asks for namespaces (not granted; kopf retried that for 54 s at every
    # start): once it watches its ModelWeights, kopf's namespace scan, which comes first, would have been audited.
    wait_for(lambda: f"watch-stream for modelweights.v1alpha1.ferry.dev in '{NAMESPACE}'" in node.kubectl(
        "logs", "-n", chart_operator["namespace"], pod["metadata"]["name"]).stdout, "the operator's watch")
    operator = f"system:serviceaccount:{chart_operator['namespace']}:{chart_operator['service_account']}"
    asked = [(e["verb"], e["responseStatus"].get("code")) for e in localcluster.audit_events()
             if e["user"]["username"] == operator and e["objectRef"].get("resource") == "namespaces"]
    assert not asked, asked
    # Its metrics, through the chart's Service: host -> ClusterIP -> kube-proxy -> the pod on the bridge.
    svc = node.get_json("service", f"{chart_operator['release']}-metrics", "-n", chart_operator["namespace"])
    url = f"http://{svc['spec']['clusterIP']}:{svc['spec']['ports'][0]['port']}/metrics"
    text = wait_for(lambda: urllib.request.urlopen(url, timeout=5).read().decode(), "the metrics endpoint")
    assert "ferry_reconcile_duration_seconds" in text and "ferry_modelweights" in text


@pytest.mark.parametrize("fmt,steps", [
    ({"type": "safetensors"}, {"fetch"}),
    ({"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}, {"fetch", "shard"}),
], ids=["safetensors", "sharded_state-tp2"])
def test_ready_through_real_jobs_from_s3(node, chart_operator, node_s3, checkpoint, fmt, steps):
    name = unique(fmt["type"].replace("_", "-"))
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    # A tenant's Secret with keys that would run her code in the prepare pod, were it imported whole (envFrom).
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3, extra=HOSTILE_KEYS)
    node.apply(modelweights(name, f"s3://{name}/tiny-llama", fmt, secret=f"{name}-s3"))
    status = wait_ready(node, NAMESPACE, name)

    assert_ran_for_real(node, name, steps)
    assert_no_hostile_env(node, name)
    # Progress went where a worker may write: a condition of its own pod (the
    # operator copies it into status.progress); never the ModelWeights itself.
    events = worker_requests(name)
    reports = progress_reported_on_own_pod(events)
    assert any(r["percent"] == 100 for r in reports), f"no progress report on a worker's own pod: {events}"
    assert not [e for e in events if e["objectRef"].get("resource") == "modelweights"], events
    # The artifact on the claim, checked from the host against its manifest.
    uri = status["artifact"]["uri"]
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    artifact = claim_dir(node, claim) / path
    verify = subprocess.run([str(FERRY), "verify", str(artifact)], capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    manifest = json.loads((artifact / "ferry-manifest.json").read_text())
    if fmt["type"] == "sharded_state":
        assert any(f["path"].startswith("model-rank-1-part-") for f in manifest["files"])
        # The fetched original is no copy to keep once the artifact is recorded: a Job removes it.
        wait_for(lambda: not (artifact.parent / "staging").exists(), "the staging directory removed", timeout=90)
    # Written by the worker's uid, not root.
    assert (artifact / "ferry-manifest.json").stat().st_uid == 65532


def test_ready_from_a_pvc_source(node, chart_operator, checkpoint):
    """`pvc://claim/path`: the source claim is mounted read-only into the fetch Job."""
    claim = unique("models")
    node.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": claim, "namespace": NAMESPACE},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    # WaitForFirstConsumer: a pod that writes the checkpoint binds the claim to the node.
    files = {f.name: f.read_text() if f.suffix in (".json", ".txt") else None for f in checkpoint.iterdir()}
    node.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{claim}-writer", "namespace": NAMESPACE},
                "spec": {"restartPolicy": "Never",
                         "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
                         "containers": [{"name": "mkdir", "image": _busybox(node), "imagePullPolicy": "Never",
                                         "command": ["/bin/sh", "-c", "mkdir -p /models/tiny-llama"],
                                         "volumeMounts": [{"name": "m", "mountPath": "/models"}]}],
                         "volumes": [{"name": "m", "persistentVolumeClaim": {"claimName": claim}}]}})
    node.kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", f"pod/{claim}-writer", "-n", NAMESPACE,
                 "--timeout=90s", timeout=100)
    target = claim_dir(node, claim) / "tiny-llama"
    for f in checkpoint.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    assert files  # the checkpoint had files to copy
    name = unique("from-pvc")
    node.apply(modelweights(name, f"pvc://{claim}/tiny-llama",
                            {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}))
    status = wait_ready(node, NAMESPACE, name)
    assert_ran_for_real(node, name, {"fetch", "shard"})
    assert condition(status, "Prepared")["status"] == "True"


def _busybox(kube) -> str:
    import localcluster
    return localcluster.built_images()["busybox"]["ref"]


def test_a_wired_deployment_lands_on_the_gpu_node(node, chart_operator, node_s3, checkpoint):
    """The serving side stays on kwok's GPU node: the toleration comes from the
    ExtendedResourceToleration admission plugin, as on GKE/AKS."""
    name = unique("served")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    labels = {"app": name}
    node.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                             "args": ["--dtype", "bfloat16"],
                                             "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}})
    mw = modelweights(name, f"s3://{name}/tiny-llama",
                      {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}]}
    node.apply(mw)
    status = wait_ready(node, NAMESPACE, name)
    pods = node.get_json("pods", "-n", NAMESPACE, "-l", f"app={name}")["items"]
    assert pods and all(p["spec"]["nodeName"] in localcluster.FAKE_NODES for p in pods)
    dep = node.get_json("deployment", name, "-n", NAMESPACE)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "sharded_state" in args
    assert dep["spec"]["template"]["metadata"]["annotations"]["ferry.dev/artifact-digest"] == \
        status["artifact"]["manifestDigest"]
    assert mw_status(node, NAMESPACE, name)["phase"] == "Ready"


def test_a_superseded_artifact_is_removed_from_the_claim(node, chart_operator, node_s3, checkpoint):
    """deletionPolicy Delete: once the new artifact is Ready, the cleanup Job
    removes the old one's directory from the claim, on the real node."""
    name = unique("gc")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    mw = modelweights(name, f"s3://{name}/tiny-llama", {"type": "sharded_state", "tensorParallelSize": 2,
                                                         "vllmVersion": "0.32"}, secret=f"{name}-s3")
    node.apply(mw)
    first = wait_ready(node, NAMESPACE, name)
    claim, _, path = first["artifact"]["uri"].removeprefix("pvc://").partition("/")
    old_dir = (claim_dir(node, claim) / path).parent
    assert old_dir.is_dir()
    mw["spec"]["format"]["tensorParallelSize"] = 4
    node.apply(mw)
    wait_for(lambda: (s := mw_status(node, NAMESPACE, name)).get("observedGeneration") == 2
             and s.get("phase") == "Ready", "generation 2 Ready", timeout=240)
    wait_for(lambda: not old_dir.exists(), f"{old_dir} removed by the cleanup Job", timeout=90)

    def gc_exit():
        pods = [p for p in job_pods(node, name) if p["metadata"]["labels"]["ferry.dev/step"] == "gc"]
        states = [(p["status"].get("containerStatuses") or [{}])[0].get("state", {}) for p in pods]
        return [s["terminated"]["exitCode"] for s in states if "terminated" in s] or None
    assert wait_for(gc_exit, "the cleanup pod's exit", timeout=60) == [0]
    current = mw_status(node, NAMESPACE, name)["artifact"]["uri"].removeprefix(f"pvc://{claim}/")
    assert (claim_dir(node, claim) / current / "ferry-manifest.json").is_file()
