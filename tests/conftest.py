"""Shared fixtures. Cluster tests run against a real kube-apiserver + etcd
(e2e/localcluster.py): reused when one is up (`make cluster-up`), otherwise
started for the session and stopped at its end."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e"))
sys.path.insert(0, str(REPO / "e2e" / "s3"))
sys.path.insert(0, str(REPO / "tests"))

import localcluster  # noqa: E402
import localnode  # noqa: E402
import cluster_support  # noqa: E402
from cluster_support import Kube  # noqa: E402

CRD_FILE = REPO / "crds" / "ferry.dev_modelweights.yaml"


LANE_ENV = "FERRY_TEST_LANE"  # tests/lanes.py runs one pytest per lane, side by side


def lane(item: pytest.Item) -> str:
    """`cluster` for a test that needs the local cluster or the node's containerd (marked cluster, node or
    images, or asking for `kube`): that lane runs in one process, one cluster for the session, as before.
    `local` for the rest: the worker's vLLM breadth suites, unit, S3 and cache tests."""
    on_cluster = "kube" in item.fixturenames or any(
        item.get_closest_marker(name) for name in ("cluster", "node", "images"))
    return "cluster" if on_cluster else "local"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With FERRY_TEST_LANE set, only that lane's tests run (the others are deselected, after -m and -k)."""
    wanted = os.environ.get(LANE_ENV)
    if not wanted:
        return
    if wanted not in ("cluster", "local"):
        raise pytest.UsageError(f"{LANE_ENV}={wanted!r}: the lanes are cluster and local")
    dropped = [item for item in items if lane(item) != wanted]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if lane(item) == wanted]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing cluster test's report carries what CI cannot be asked for afterwards: the tail of each
    operator log the test wrote, and its namespace's objects and events."""
    if call.when == "setup":
        cluster_support.OPERATOR_LOGS.clear()
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when == "teardown":
        return
    for log in cluster_support.OPERATOR_LOGS:
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-200:]
            report.sections.append((f"operator log {log.name} (last 200 lines)", "\n".join(tail)))
    kube, ns = item.funcargs.get("kube") or item.funcargs.get("crd"), item.funcargs.get("namespace")
    if isinstance(kube, Kube) and isinstance(ns, str):
        for what in (["get", "mw,jobs,pods,pvc,deployments", "-o", "wide"], ["get", "mw", "-o", "yaml"],
                     ["get", "events", "--sort-by=.lastTimestamp"]):
            try:
                got = kube.kubectl(*what, "-n", ns, check=False, timeout=20)
                text = (got.stdout or "") + (got.stderr or "")
            except subprocess.TimeoutExpired as exc:
                text = str(exc)
            report.sections.append((f"kubectl {' '.join(what)} -n {ns}", text))


@pytest.fixture(scope="session")
def kube() -> Kube:
    cluster = localcluster.Cluster()
    started = False
    if not cluster.running():
        cluster.up()
        started = True
    yield Kube(localcluster.KUBECONFIG, localcluster.kubectl_path())
    if started and not os.environ.get("FERRY_KEEP_CLUSTER"):
        cluster.down(quiet=True)
        # The session started it, so the session proves it stopped all of it:
        # kubelet, containerd, shims, pod processes, mounts, links, iptables rules.
        left = {k: v for k, v in localnode.leftovers(localcluster.node_paths()).items() if v}
        assert not left, f"the local cluster left things behind after down: {left}"


@pytest.fixture(scope="session")
def crd(kube: Kube) -> Kube:
    """The generated CRD applied and Established."""
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    localcluster.wait_crd_established("modelweights.ferry.dev", kube.kubeconfig)
    return kube


@pytest.fixture
def namespace(kube: Kube) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)




@pytest.fixture(scope="session")
def images(kube: Kube) -> dict[str, dict[str, str]]:
    """The images `make images` builds from this working tree (a Python-only
    change rebuilds one layer in seconds), imported into the real node's containerd."""
    built = localcluster.built_images()
    localcluster.import_images(localnode.Node(localcluster.node_paths()), built)
    return built


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The python of the vLLM CPU venv (e2e/vllm/install.sh); a test that needs it fails, never skips, without it."""
    check = subprocess.run(["bash", str(REPO / "e2e/vllm/install.sh"), "--check"], capture_output=True, text=True)
    if check.returncode != 0:
        pytest.fail(f"the vLLM CPU venv is missing: run e2e/vllm/install.sh ({check.stderr.strip()})")
    return check.stdout.strip()


@pytest.fixture(scope="session")
def hf_checkpoints(vllm_python: str, tmp_path_factory: pytest.TempPathFactory):
    """Checkpoints transformers wrote (tests/hf_checkpoints.py): each case once per session, shared."""
    from hf_checkpoints import HfCheckpoints
    from vllm_tokens import CPU_ENGINE_ENV

    return HfCheckpoints(vllm_python, tmp_path_factory.mktemp("hf-checkpoints"), {**os.environ, **CPU_ENGINE_ENV})


@pytest.fixture(scope="session")
def vllm_references(tmp_path_factory: pytest.TempPathFactory):
    """vLLM's greedy tokens on original checkpoints (vllm_tokens.ReferenceStore): each (checkpoint, TP)
    computed once per session, shared by every suite that compares against it."""
    from vllm_tokens import ReferenceStore

    store = ReferenceStore(tmp_path_factory.mktemp("vllm-references"))
    yield store
    store.stop()
