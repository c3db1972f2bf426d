"""The kopf glue without a cluster: a 403 from the executor becomes a Stalled
status (the reconciler keeps looking), and the first reconcile after the
permission is granted converges."""
from __future__ import annotations

import json

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from ferry_operator import handlers
from ferry_operator.planner import StepPhase, StepState
from spec_cases import manifest, with_

DENIED = ('pods is forbidden: User "system:serviceaccount:ferry-system:ferry-operator" cannot list resource "pods" '
          'in API group "" in the namespace "ml"')


def forbidden_error(message: str) -> ApiException:
    exc = ApiException(status=403, reason="Forbidden")
    exc.body = json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                           "message": message, "reason": "Forbidden", "details": {"kind": "pods"}, "code": 403})
    return exc


class Executor:
    def __init__(self):
        self.error: Exception | None = forbidden_error(DENIED)
        self.started: list[str] = []

    def observe(self, mw, step):
        if self.error is not None:
            raise self.error
        return StepState(StepPhase.RUNNING if step.id in self.started else StepPhase.NOT_STARTED)

    def start(self, mw, uid, step):
        self.started.append(step.id)

    def artifact_uri(self, mw, last):
        return f"pvc://weights/{last.digest}"

    def artifact(self, mw, last):
        return None


@pytest.fixture
def executor(monkeypatch):
    ex = Executor()
    ex.events = []
    monkeypatch.setattr(handlers, "EXECUTOR", ex)
    # kopf posts Events from its own loop, absent here: record them instead.
    monkeypatch.setattr(handlers.kopf, "event", lambda body, **e: ex.events.append((e["type"], e["reason"])))
    return ex


def reconcile(body):
    """One reconcile, and the body as its status patch leaves it."""
    outcome = handlers.reconcile_once(body, "ml", "llama", "uid-1", {})
    body = json.loads(json.dumps(body))
    status = {**(body.get("status") or {}), **outcome.status_patch}
    body["status"] = {k: v for k, v in status.items() if v is not None}  # merge patch: null removes
    return body, outcome


def conditions(body):
    return {c["type"]: c for c in body["status"]["conditions"]}


def test_a_forbidden_call_stalls_with_who_may_not_do_what_and_then_converges(executor):
    body = with_("serving", None)
    body["metadata"].update(namespace="ml", uid="uid-1", generation=1)
    body, outcome = reconcile(body)
    stalled = conditions(body)["Stalled"]
    assert (stalled["status"], stalled["reason"]) == ("True", "Forbidden")
    assert "ServiceAccount ferry-system/ferry-operator may not list pods in namespace ml" in stalled["message"]
    assert "ClusterRole" in stalled["message"]
    assert body["status"]["phase"] == "Failed" and conditions(body)["Ready"]["status"] == "False"
    assert executor.started == []
    assert executor.events == [("Warning", "Forbidden")]
    # A grant sends no watch event: the reconciler keeps polling, not waiting for a resync.
    assert outcome.delay == handlers.RECONCILE_INTERVAL

    executor.error = None  # the ClusterRole fixed
    body, outcome = reconcile(body)
    assert conditions(body)["Stalled"]["status"] == "False"
    assert (conditions(body)["Reconciling"]["status"], conditions(body)["Reconciling"]["reason"]) == ("True", "Fetch")
    assert body["status"]["phase"] == "Fetching" and len(executor.started) == 1
    assert executor.events[1:] == [("Normal", "StepStarted")]
    assert outcome.delay == handlers.WAKE_COALESCE_S  # it acted: it looks again at once

    body, outcome = reconcile(body)  # "starting" becomes "running"
    assert outcome.delay == handlers.RECONCILE_INTERVAL  # a step runs: the poll behind the events
    _, outcome = reconcile(body)
    assert outcome.status_patch == {}  # nothing changed: nothing to write


def test_other_api_errors_are_left_to_the_reconcilers_backoff(executor):
    executor.error = ApiException(status=500, reason="Internal Server Error")
    body = manifest()
    body["metadata"].update(namespace="ml", uid="uid-1", generation=1)
    with pytest.raises(ApiException):
        reconcile(body)


def test_an_event_about_a_serving_pod_is_posted_on_that_pod_with_its_uid(monkeypatch):
    from ferry_operator.api.types import ModelWeightsStatus
    from ferry_operator.events import Event

    posted = []
    monkeypatch.setattr(handlers.kopf, "event", lambda body, **e: posted.append((body, e["reason"])))
    body = {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1"}}
    handlers._report(body, "uid-1", None, [Event("Warning", "NodeCacheCorrupt", "corrupt", pod="llama-7d-x"),
                                           Event("Warning", "NodeCacheEvicted", "gone")],
                     ModelWeightsStatus(), pod_uids={"llama-7d-x": "uid-pod"})
    # `kubectl describe pod` finds Events by the pod's uid too.
    assert posted == [({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "llama-7d-x", "namespace": "ml", "uid": "uid-pod"}}, "NodeCacheCorrupt"), (body, "NodeCacheEvicted")]


def test_the_status_patch_nulls_artifact_fields_the_operator_no_longer_sets():
    """A merge patch merges maps: facts someone else wrote into status.artifact (a forged `experts`) are
    removed by the operator's next write, not kept beside its own."""
    from ferry_operator.api.types import ModelWeightsStatus
    from ferry_operator.handlers import _status_patch

    mine = {"uri": "pvc://c/u/d", "format": "safetensors", "totalBytes": 3, "manifestDigest": "sha256:" + "ab" * 32}
    forged = {**mine, "totalBytes": 1 << 50, "experts": 256, "expertParallel": True}
    patch = _status_patch({"artifact": forged}, ModelWeightsStatus.model_validate({"artifact": mine}))
    assert patch["artifact"]["experts"] is None and patch["artifact"]["expertParallel"] is None
    assert patch["artifact"]["totalBytes"] == 3


def test_the_status_patch_writes_and_clears_compiled_state():
    from ferry_operator.api.types import ModelWeightsStatus
    from ferry_operator.handlers import _status_patch

    status = ModelWeightsStatus.model_validate({"compiledState": {"key": "k", "restoredReplicas": 1}})
    patch = _status_patch({}, status)
    assert patch["compiledState"]["restoredReplicas"] == 1
    assert _status_patch({"compiledState": {"key": "k"}}, ModelWeightsStatus())["compiledState"] is None
