"""A prepare Job's worker holds no power over ModelWeights, on the real API server.

It runs as the chart's worker ServiceAccount and parses untrusted bytes, so it
may change nothing but its own pod: its progress goes into the condition
ferry.dev/progress of its pod (the self-report policy lets its pod-bound token
change that condition of that pod only), and the operator copies it into
status.progress. The same token may not patch any ModelWeights, its status
included, nor another pod.
"""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

import localcluster
from cluster_support import TEST_RELEASE, Kube, admission_policies, token_dir, wait_for
from ferry_worker.progress import Snapshot
from ferry_worker.progress_report import CONDITION, PodProgress
from test_weights_reporter_policy import _ok, reporter, serving_pod

pytestmark = pytest.mark.cluster


def chart_worker_role() -> dict:
    (role,) = [d for d in localcluster.render_chart(TEST_RELEASE, "templates/rbac.yaml")
               if d["kind"] == "ClusterRole" and d["metadata"]["name"] == f"{TEST_RELEASE}-worker"]
    return role


@pytest.fixture
def worker(crd: Kube, namespace: str) -> str:
    admission_policies(crd)  # the chart's self-report policy (release ferry-tests)
    crd.apply(chart_worker_role())
    crd.apply({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "serving", "namespace": namespace}})
    crd.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "ferry-worker", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                           "name": f"{TEST_RELEASE}-worker"},
               "subjects": [{"kind": "ServiceAccount", "name": "serving", "namespace": namespace}]})
    crd.apply({"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
               "metadata": {"name": "llama", "namespace": namespace},
               "spec": {"source": {"uri": "s3://models/llama-3-8b/"}, "storage": {"pvc": {"name": "weights"}}}})
    return namespace


def snapshot(done: int, total: int) -> Snapshot:
    return Snapshot(step="fetch", bytes_done=done, bytes_total=total, bytes_per_second=25, eta_seconds=6,
                    updated_at=datetime(2026, 12, 1, 10, 0, 0, tzinfo=timezone.utc))


def test_a_worker_reports_progress_on_its_own_pod_and_cannot_touch_any_modelweights(crd, worker, tmp_path,
                                                                                   monkeypatch):
    namespace = worker
    # Pods on kwok: the pod objects are what matter here.
    a, _ = serving_pod(crd, namespace, "fetch-a"), serving_pod(crd, namespace, "fetch-b")
    tokens = token_dir(crd, "serving", namespace, tmp_path, a)
    api = reporter(crd, "fetch-a", tokens, monkeypatch)._api  # the in-cluster client, as in the pod
    own = PodProgress("fetch-a", namespace, api)

    wait_for(lambda: _ok(lambda: own.write(snapshot(50, 200))), "the self-report policy allows its own progress")
    pod = crd.get_json("pod", "fetch-a", "-n", namespace)
    (condition,) = [c for c in pod["status"]["conditions"] if c["type"] == CONDITION]
    assert condition["status"] == "Unknown" and condition["reason"] == "Running"
    assert json.loads(condition["message"])["bytesDone"] == 50

    with pytest.raises(PermissionError, match="on itself only: pod fetch-a tried to change pod fetch-b"):
        PodProgress("fetch-b", namespace, api).write(snapshot(1, 2))

    # With the same token: no write to any ModelWeights, status or spec.
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    custom = client.CustomObjectsApi(api.api_client)
    for call in (lambda: custom.patch_namespaced_custom_object_status(
                     "ferry.dev", "v1alpha1", namespace, "modelweights", "llama",
                     {"status": {"artifact": {"uri": "file:///etc", "format": "safetensors"}}}),
                 lambda: custom.patch_namespaced_custom_object(
                     "ferry.dev", "v1alpha1", namespace, "modelweights", "llama", {"spec": {"deletionPolicy": "Delete"}}),
                 lambda: custom.get_namespaced_custom_object("ferry.dev", "v1alpha1", namespace, "modelweights", "llama")):
        with pytest.raises(ApiException) as denied:
            call()
        assert denied.value.status == 403
    assert "artifact" not in (crd.get_json("mw", "llama", "-n", namespace).get("status") or {})
