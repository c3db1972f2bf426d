"""The kopf glue of a node cache prewarm without a cluster: the nodes come from the operator's node index
(a watch), never from a LIST per reconcile, and while a prewarm holds the rollout the poll behind the
events backs off. The planner's side: tests/test_node_cache_plan.py."""
from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone

import pytest

from ferry_operator import handlers
from ferry_operator.node_cache import FillFacts
from ferry_operator.placement import NodeFacts
from ferry_operator.planner import ArtifactFacts, StepPhase, StepState
from ferry_operator.serving.wiring import WorkloadFacts
from spec_cases import with_

NAME = "llama-70b-vllm"
DIGEST = "sha256:" + "1" * 64


class CountingClient:
    """Stands in for every kubernetes API client the handlers hold: counts each call by method name."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __getattr__(self, method: str):
        def call(*_, **__):
            self.calls[method] += 1
            if method == "list_node":  # as the API answers (_preload_content=False)
                return type("Response", (), {"data": json.dumps({"items": [{"metadata": {"name": "gpu-a"}}]})})
            return None
        return call


class FillingExecutor:
    """The prepare steps done; fill Jobs recorded, each Running until the test confirms it."""

    def __init__(self) -> None:
        self.jobs: list[FillFacts] = []

    def observe(self, mw, step):
        return StepState(StepPhase.SUCCEEDED)

    def artifact_uri(self, mw, last):
        return "pvc://llama-weights/llama/abc"

    def artifact(self, mw, last):
        return ArtifactFacts(uri="pvc://llama-weights/llama/abc", total_bytes=3 << 30, manifest_digest=DIGEST)

    def fills(self, mw):
        return list(self.jobs)

    def fill(self, mw, uid, node, artifact, round_, placement=None):
        self.jobs.append(FillFacts(node, DIGEST, "Running", round=round_, job=f"fill-{node}-{round_}"))

    def remove_fill(self, mw, node, digest, round_):
        self.jobs = [j for j in self.jobs if (j.node, j.round) != (node, round_)]


@pytest.fixture
def cluster(monkeypatch):
    clients = {name: CountingClient() for name in ("APPS", "CUSTOM", "RBAC", "CORE")}
    for name, client in clients.items():
        monkeypatch.setattr(handlers, name, client, raising=False)
    executor = FillingExecutor()
    monkeypatch.setattr(handlers, "EXECUTOR", executor)
    monkeypatch.setattr(handlers, "POLICIES", None)
    monkeypatch.setattr(handlers, "NODE_AGENT", True)
    monkeypatch.setattr(handlers, "RECONCILE_INTERVAL", 2.0)
    monkeypatch.setattr(handlers, "PREWARM_BACKOFF_MAX_S", 30.0)
    monkeypatch.setattr(handlers.kopf, "event", lambda body, **e: None)
    return clients, executor


def reconcile(body, indexes):
    outcome = handlers.reconcile_once(body, "ml", "llama", "uid-1", indexes)
    status = {**(body.get("status") or {}), **outcome.status_patch}
    return {**body, "status": {k: v for k, v in status.items() if v is not None}}, outcome.delay


def test_a_held_prewarm_lists_no_nodes_and_its_poll_backs_off(cluster):
    clients, executor = cluster
    body = with_("serving.nodeCache", {"enabled": True, "prewarm": {"nodeSelector": {"pool": "h100"}}})
    body["metadata"].update(namespace="ml", uid="uid-1", generation=1)
    deployment = WorkloadFacts(name=NAME, containers={"vllm": ["--model", "meta-llama/Meta-Llama-3-70B-Instruct"]},
                               template_annotations={}, rolled_out=True)
    indexes = {"deployments": {("ml", NAME): [deployment]},
               "nodes": {"gpu-a": NodeFacts("gpu-a", {"pool": "h100"}), "cpu-0": NodeFacts("cpu-0", {})}}

    body, delay = reconcile(body, indexes)
    assert [j.node for j in executor.jobs] == ["gpu-a"]  # selected from the index: gpu-a only
    assert delay == handlers.WAKE_COALESCE_S  # it acted
    delays = []
    for _ in range(6):  # the fill runs: held, nothing to do but wait for its events
        body, delay = reconcile(body, indexes)
        delays.append(delay)
    assert delays == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert "prewarming the node cache before the rollout: 0/1" in json.dumps(body["status"]["conditions"])
    assert sum(c.calls["list_node"] for c in clients.values()) == 0
    assert all(not c.calls for c in clients.values()), {n: dict(c.calls) for n, c in clients.items()}

    # Warm: the hold ends, the Deployment is patched, and the poll is the usual one again.
    executor.jobs = [FillFacts("gpu-a", DIGEST, "Succeeded", round=1, confirmed=True,
                               finished_at=datetime.now(timezone.utc))]
    body, delay = reconcile(body, indexes)
    assert clients["APPS"].calls["patch_namespaced_deployment"] == 1 and delay == handlers.WAKE_COALESCE_S
    assert handlers._held[("ml", "llama")] == 0
