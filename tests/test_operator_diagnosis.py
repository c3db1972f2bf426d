"""Prepare Jobs that cannot make progress, against the real API server: the
operator reports why (Stalled, or the Reconciling message while it may still
resolve) instead of "running" forever, and converges once the cause is fixed.

The operator runs as the chart's operator ClusterRole (rendered by helm, bound
to a ServiceAccount token), so these tests also prove that role is enough for
the diagnosis, and name what happens when it is not. The Job pods carry a node
selector no node matches: what is checked here is decided before any kubelet
(the PersistentVolume controller, the scheduler, RBAC). What a kubelet reports
(a missing Secret, an image, the worker's exit) is in tests/test_diagnosis.py.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from cluster_support import Kube, running_operator, wait_for
from operator_identity import chart_operator_role, operator_identity, without

pytestmark = [pytest.mark.cluster, pytest.mark.helm]

REPO = Path(__file__).resolve().parent.parent
IMAGE = "ghcr.io/ferry-dev/ferry:test"
NOWHERE = {"ferry.dev/test-node": "none"}  # no node has it: the pods stay unscheduled


@contextlib.contextmanager
def static_volume(kube: Kube, namespace: str, storage_class: str):
    """A pre-provisioned PersistentVolume of `storage_class` (no provisioner needed)."""
    name = f"pv-{namespace}"
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
                "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce", "ReadWriteMany"],
                         "storageClassName": storage_class, "hostPath": {"path": f"/tmp/{namespace}"}}})
    try:
        yield name
    finally:
        kube.kubectl("delete", "pv", name, "--wait=false", check=False)


def operator_env(kubeconfig: Path) -> dict[str, str]:
    return {"KUBECONFIG": str(kubeconfig), "FERRY_EXECUTOR": "kubernetes", "FERRY_WORKER_IMAGE": IMAGE,
            "FERRY_WORKER_NODE_SELECTOR": json.dumps(NOWHERE)}


def modelweights(namespace: str, storage_class: str) -> dict:
    return {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": "llama", "namespace": namespace},
            "spec": {"source": {"uri": "hf://org/tiny-llama"},
                     "storage": {"pvc": {"size": "1Gi", "storageClassName": storage_class}},
                     "format": {"type": "safetensors"}}}


def condition(kube: Kube, namespace: str, type_: str) -> dict:
    status = kube.get_json("mw", "llama", "-n", namespace).get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == type_), {})


def wait_condition(kube, namespace, type_, status, reason, timeout=60) -> dict:
    def ok():
        c = condition(kube, namespace, type_)
        return c if (c.get("status"), c.get("reason")) == (status, reason) else None
    try:
        return wait_for(ok, f"{type_}={status}/{reason}", timeout=timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}; conditions now: {kube.get_json('mw', 'llama', '-n', namespace).get('status')}")


def test_a_claim_whose_storage_class_does_not_exist_stalls_then_binds(crd, namespace, tmp_path):
    missing = f"missing-{namespace}"
    with operator_identity(crd, namespace, chart_operator_role(), tmp_path) as (kubeconfig, _), \
            running_operator(crd, namespace, tmp_path / "operator.log", **operator_env(kubeconfig)):
        crd.apply(modelweights(namespace, missing))
        stalled = wait_condition(crd, namespace, "Stalled", "True", "StorageClassNotFound")
        assert stalled["message"].startswith(
            f'fetch failed: PersistentVolumeClaim {namespace}/llama-weights is Pending: StorageClass "{missing}" '
            "does not exist (spec.storage.pvc.storageClassName)"), stalled["message"]
        assert crd.get_json("mw", "llama", "-n", namespace)["status"]["phase"] == "Failed"
        # What the real control plane did meanwhile: the claim Pending, the pod unschedulable for it.
        assert crd.get_json("pvc", "llama-weights", "-n", namespace)["status"]["phase"] == "Pending"
        (job,) = crd.get_json("jobs", "-n", namespace)["items"]
        (pod,) = crd.get_json("pods", "-n", namespace, "-l", f"job-name={job['metadata']['name']}")["items"]
        scheduled = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
        assert scheduled["reason"] == "Unschedulable"
        assert "pod has unbound immediate PersistentVolumeClaims" in scheduled["message"]
        # The API server took the Job's podFailurePolicy as built.
        assert job["spec"]["podFailurePolicy"]["rules"][0]["action"] == "FailJob"

        # A volume of that class appears (a static PV needs no StorageClass object): the claim binds,
        # the stall ends, and the next thing in the way (the node selector) is the Reconciling message.
        with static_volume(crd, namespace, missing):
            reconciling = wait_condition(crd, namespace, "Reconciling", "True", "Unschedulable", timeout=90)
            assert "didn't match Pod's node affinity/selector" in reconciling["message"], reconciling["message"]
            assert "worker.nodeSelector" in reconciling["message"]
            assert condition(crd, namespace, "Stalled")["status"] == "False"
            assert crd.get_json("mw", "llama", "-n", namespace)["status"]["phase"] == "Fetching"


@pytest.mark.parametrize("group,resource,verb", [("batch", "jobs", "create"),
                                                 ("", "persistentvolumeclaims", "create")])
def test_a_permission_the_operator_lacks_stalls_then_converges_once_granted(crd, namespace, tmp_path,
                                                                            group, resource, verb):
    role = chart_operator_role()
    with operator_identity(crd, namespace, without(role, group, resource, verb), tmp_path) as (kubeconfig, apply), \
            static_volume(crd, namespace, f"manual-{namespace}"), \
            running_operator(crd, namespace, tmp_path / "operator.log", **operator_env(kubeconfig)) as operator:
        crd.apply(modelweights(namespace, f"manual-{namespace}"))
        stalled = wait_condition(crd, namespace, "Stalled", "True", "Forbidden")
        what = f"{resource}.{group}" if group else resource
        assert (f"the operator's ServiceAccount {namespace}/ferry-operator may not {verb} {what} in namespace "
                f"{namespace}") in stalled["message"], stalled["message"]
        assert "ClusterRole" in stalled["message"]
        assert condition(crd, namespace, "Ready")["status"] == "False"
        assert operator.poll() is None  # the handler loop goes on

        apply(role)  # the chart's role, whole again
        wait_condition(crd, namespace, "Stalled", "False", "Progressing")
        wait_condition(crd, namespace, "Reconciling", "True", "Unschedulable")
        assert len(crd.get_json("jobs", "-n", namespace)["items"]) == 1


def test_a_watch_the_operator_may_not_make_stops_it_naming_the_permission(crd, namespace, tmp_path):
    """kopf's indexes need list+watch: without it the operator would sit idle, so it refuses to start."""
    with operator_identity(crd, namespace, without(chart_operator_role(), "", "pods", "list"), tmp_path) \
            as (kubeconfig, _), \
            running_operator(crd, namespace, tmp_path / "operator.log", **operator_env(kubeconfig)) as operator:
        assert operator.wait(timeout=60) == 1
        log = (tmp_path / "operator.log").read_text()
        assert f"may not list pods in namespace {namespace}" in log, log[-2000:]
        assert "the chart's operator role (charts/ferry/templates/rbac.yaml" in log, log[-2000:]


def test_a_step_past_its_deadline_stalls_naming_the_deadline_and_the_chart_value(crd, namespace, tmp_path):
    """The Job controller's own activeDeadlineSeconds (from the chart value, here 3s): its pod never gets
    a node, the deadline passes, the Job fails with DeadlineExceeded, and the step stalls for good."""
    env = {"FERRY_WORKER_ACTIVE_DEADLINE_SECONDS": "3"}
    with operator_identity(crd, namespace, chart_operator_role(), tmp_path) as (kubeconfig, _), \
            static_volume(crd, namespace, f"manual-{namespace}"), \
            running_operator(crd, namespace, tmp_path / "operator.log", **{**operator_env(kubeconfig), **env}):
        crd.apply(modelweights(namespace, f"manual-{namespace}"))
        stalled = wait_condition(crd, namespace, "Stalled", "True", "DeadlineExceeded", timeout=90)
        (job,) = crd.get_json("jobs", "-n", namespace)["items"]
        assert job["spec"]["activeDeadlineSeconds"] == 3
        # The Job controller's verdict (FailureTarget first, Failed once its pod has terminated).
        verdict = {c["type"]: c["reason"] for c in job["status"]["conditions"] if c["status"] == "True"}
        assert verdict.get("FailureTarget") == "DeadlineExceeded", verdict
        assert stalled["message"].startswith(
            f"fetch failed: Job {namespace}/{job['metadata']['name']} ran past its deadline of 3s"), stalled["message"]
        assert "worker.activeDeadlineSeconds" in stalled["message"]
        assert condition(crd, namespace, "Ready")["status"] == "False"
        # Not retried by itself: the same Job would run into the same deadline.
        assert (crd.get_json("mw", "llama", "-n", namespace)["status"].get("retry") or {}) == {}
        assert crd.get_json("jobs", "-n", namespace)["items"][0]["metadata"]["uid"] == job["metadata"]["uid"]
