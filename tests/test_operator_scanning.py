"""kopf's scanning off for a namespaced operator, and its one restart for an optional CRD installed later
(operator/ferry_operator/handlers/crds.py), without a cluster: the CLI's settings and the restart decision.
That the namespaced chart operator never asks for namespaces is checked on the real cluster, in the API
server's audit log (tests/node/test_prepare_on_node.py). Shares nothing, starts nothing."""
from __future__ import annotations

import asyncio

import pytest

from ferry_operator import cli
from ferry_operator.handlers import crds

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
ESTABLISHED = {"status": {"conditions": [{"type": "NamesAccepted", "status": "True"},
                                         {"type": "Established", "status": "True"}]}}
NOT_YET = {"status": {"conditions": [{"type": "Established", "status": "False"}]}}


@pytest.fixture
def kopf_run(monkeypatch):
    import kopf

    import ferry_operator.preflight as preflight

    calls = []
    monkeypatch.setattr(preflight, "check", lambda namespaces: None)
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    return calls


@pytest.mark.parametrize("argv,scanning_off", [
    (["run", "--standalone", "--namespace", "ml", "--namespace", "research"], True),
    (["run", "--standalone", "--all-namespaces"], False),
], ids=["named", "all"])
def test_named_namespaces_turn_kopfs_scanning_off(kopf_run, argv, scanning_off):
    assert cli.main(argv) == 0
    (kwargs,) = kopf_run
    assert kwargs["settings"].scanning.disabled is scanning_off
    assert kwargs["clusterwide"] is not scanning_off
    assert kwargs["stop_flag"] is crds.STOP


def test_a_crd_missing_at_start_stops_the_operator_once_it_is_established():
    crds.STOP.clear()
    assert crds.note_missing(lambda name: None) == {LWS_CRD}
    assert not crds.restart_for(LWS_CRD, NOT_YET)
    asyncio.run(crds.optional_crd_changed(name=LWS_CRD, body=NOT_YET))
    assert not crds.STOP.is_set()
    asyncio.run(crds.optional_crd_changed(name=LWS_CRD, body=ESTABLISHED))
    assert crds.STOP.is_set()
    crds.STOP.clear()


def test_a_crd_established_at_start_stops_nothing():
    crds.STOP.clear()
    assert crds.note_missing(lambda name: ESTABLISHED) == set()
    asyncio.run(crds.optional_crd_changed(name=LWS_CRD, body=ESTABLISHED))
    assert not crds.STOP.is_set()
