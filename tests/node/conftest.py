"""Fixtures for the real-node tests (`-m node`): the chart installed into the
local cluster with the image built here, the operator running in a pod on the
real node under the chart's ServiceAccount, and an S3 server that pods reach
on the node's bridge address. Helpers: node_support.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "e2e" / "s3"))
sys.path.insert(0, str(REPO / "tests" / "node"))

import localcluster  # noqa: E402
import localnode  # noqa: E402
from cluster_support import Kube  # noqa: E402
from node_support import (NAMESPACE, NODE_CACHE_HIGH, NODE_CACHE_LOW, cluster_write_grants, install_chart,  # noqa: E402
                          uninstall_chart)
from s3server import S3Server  # noqa: E402
from checkpoints import LLAMA3, write_checkpoint  # noqa: E402


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


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    write_checkpoint(directory, LLAMA3)
    return directory


@pytest.fixture(scope="session")
def chart_operator(node: Kube, images) -> dict[str, str]:
    """`helm install` of the chart: the operator as a pod on the real node."""
    # Not "ferry"/"ferry-system": tests/test_chart.py installs that one.
    release, namespace = "ferry-node", "ferry-node-system"
    paths = localcluster.node_paths()
    # The node cache agent (issue 17) on the real node: its kubelet directory, a cache directory of the
    # node's, the node kubelet's evictionHard (1%, e2e/localnode.py), small watermarks, short mount waits.
    install_chart(node, release, namespace, NAMESPACE, images["ferry"]["ref"],
                  "nodeCache.enabled=true", f"nodeCache.kubeletDir={paths.kubelet_root}",
                  f"nodeCache.hostPath={paths.root / 'node-cache'}", f"nodeCache.high={NODE_CACHE_HIGH}",
                  f"nodeCache.low={NODE_CACHE_LOW}", "nodeCache.kubeletEvictionHard=1%",
                  "nodeCache.mountWaitSeconds=5")
    # The whole node e2e runs under the namespaced install: write verbs in Roles of the watched namespace only.
    writes = cluster_write_grants(node, release, namespace)
    assert not writes, f"the namespaced install grants write verbs cluster-wide: {writes}"
    operator = f"system:serviceaccount:{namespace}:{release}-operator"
    for ns in ("kube-system", "default", namespace):
        assert node.kubectl("auth", "can-i", "create", "jobs.batch", "-n", ns, "--as", operator,
                            check=False).stdout.strip() == "no", f"the operator may create Jobs in {ns}"
    # "role": the operator's Role in the watched namespace (the namespaced grants; no operator ClusterRole holds them).
    yield {"release": release, "namespace": namespace, "watch": NAMESPACE, "image": images["ferry"]["ref"],
           "service_account": f"{release}-operator", "role": f"{release}-operator"}
    uninstall_chart(node, release, namespace, NAMESPACE)
