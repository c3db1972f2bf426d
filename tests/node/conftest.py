"""Fixtures for the real-node tests (`-m node`): the chart installed into the
local cluster with the image built here, the operator running in a pod on the
real node under the chart's ServiceAccount, and an S3 server that pods reach
on the node's bridge address."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "e2e" / "s3"))

import localcluster  # noqa: E402
import localnode  # noqa: E402
from cluster_support import Kube, wait_for  # noqa: E402
from s3server import S3Server  # noqa: E402

CHART = REPO / "charts" / "ferry"
# The namespace the chart's operator watches; every ModelWeights of these tests lives there.
NAMESPACE = "node-e2e"


@pytest.fixture(scope="session")
def node(crd: Kube) -> Kube:
    """The cluster, with its real node Ready."""
    ready = crd.kubectl("get", "node", localnode.NODE_NAME, "-o",
                        'jsonpath={.status.conditions[?(@.type=="Ready")].status}').stdout
    assert ready == "True", f"node {localnode.NODE_NAME} is not Ready (FERRY_NODE=0?)"
    return crd


@pytest.fixture(scope="session")
def node_s3(tmp_path_factory: pytest.TempPathFactory) -> S3Server:
    """gofakes3 on the node's bridge address: reachable from pods, and from nowhere off this machine."""
    with S3Server(tmp_path_factory.mktemp("s3-node"), host=localnode.NODE_IP) as server:
        yield server


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(localcluster.binaries() / "helm"), "--kubeconfig", str(localcluster.KUBECONFIG),
                           *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def install_chart(kube: Kube, release: str, namespace: str, watch: str, image_ref: str, *sets: str) -> None:
    repository, _, tag = image_ref.rpartition(":")
    kube.kubectl("create", "namespace", watch, check=False)
    args = ["upgrade", "--install", release, str(CHART), "--namespace", namespace, "--create-namespace",
            "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
            "--set", "image.pullPolicy=Never",
            "--set", f"operator.watchNamespaces={{{watch}}}",
            # Two cores on this node: small requests so Jobs and the operator fit.
            "--set", "operator.resources.requests.cpu=50m",
            "--set-json", 'worker.resources={"requests":{"cpu":"100m","memory":"256Mi"},"limits":{"memory":"1Gi"}}',
            "--set", "operator.logLevel=debug", "--wait", "--timeout", "180s"]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args, check=False)
    if proc.returncode != 0:
        pods = kube.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        describe = kube.kubectl("describe", "pods", "-n", namespace, check=False).stdout[-4000:]
        raise AssertionError(f"helm install {release} failed:\n{proc.stderr}\n{pods}\n{describe}")


def uninstall_chart(kube: Kube, release: str, namespace: str, watch: str) -> None:
    # The operator must still run to let its ModelWeights go (kopf's finalizer).
    kube.kubectl("delete", "mw", "--all", "-n", watch, "--timeout=90s", check=False, timeout=120)
    helm("uninstall", release, "--namespace", namespace, "--wait", "--timeout", "120s", check=False)
    kube.kubectl("delete", "namespace", watch, "--wait=false", check=False)


@pytest.fixture(scope="session")
def chart_operator(node: Kube, images) -> dict[str, str]:
    """`helm install` of the chart: the operator as a pod on the real node."""
    # Not "ferry"/"ferry-system": tests/test_chart.py installs that one.
    release, namespace = "ferry-node", "ferry-node-system"
    install_chart(node, release, namespace, NAMESPACE, images["ferry"]["ref"])
    yield {"release": release, "namespace": namespace, "watch": NAMESPACE, "image": images["ferry"]["ref"],
           "service_account": f"{release}-operator", "cluster_role": f"{release}-operator"}
    uninstall_chart(node, release, namespace, NAMESPACE)


def operator_pod(kube: Kube, namespace: str) -> dict:
    (pod,) = kube.get_json("pods", "-n", namespace, "-l", "app.kubernetes.io/component=operator")["items"]
    return pod


def s3_secret(kube: Kube, namespace: str, name: str, s3: S3Server) -> None:
    """The credentials Secret a ModelWeights references (its keys become the worker's env)."""
    env = s3.env()
    kube.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace},
                "stringData": env})


def upload_dir(s3: S3Server, bucket: str, prefix: str, directory: Path) -> None:
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(directory)}")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def mw_status(kube: Kube, namespace: str, name: str) -> dict:
    return kube.get_json("mw", name, "-n", namespace).get("status", {})


def condition(status: dict, kind: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == kind), {})


def wait_ready(kube: Kube, namespace: str, name: str, timeout: float = 240, stalled_ok: bool = False) -> dict:
    def ready():
        status = mw_status(kube, namespace, name)
        stalled = condition(status, "Stalled")
        if stalled.get("status") == "True" and not stalled_ok:
            raise AssertionError(f"{name} Stalled: {stalled.get('reason')}: {stalled.get('message')}")
        return status if condition(status, "Ready").get("status") == "True" else None
    try:
        return wait_for(ready, f"{name} Ready", timeout)
    except AssertionError:
        pods = kube.kubectl("get", "pods", "-n", namespace, "-o", "wide", check=False).stdout
        print(pods, json.dumps(mw_status(kube, namespace, name), indent=1))
        raise


def wait_stalled(kube: Kube, namespace: str, name: str, timeout: float = 120) -> dict:
    def stalled():
        c = condition(mw_status(kube, namespace, name), "Stalled")
        return c if c.get("status") == "True" else None
    return wait_for(stalled, f"{name} Stalled", timeout)
