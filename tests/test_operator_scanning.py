"""kopf's scanning off for a namespaced operator, and its new start when an optional CRD comes or goes
(operator/ferry_operator/handlers/crds.py), without a cluster: the CLI's settings, names and new start, and
the restart decision. On the real cluster: the namespaced chart operator never asks for namespaces (the API
server's audit log, tests/node/test_prepare_on_node.py), and SIGTERM still stops an operator started with
this stop flag (tests/test_operator_restart.py ends its operator with SIGTERM and fails if it still runs 20 s
later). Shares nothing, starts nothing."""
from __future__ import annotations

import asyncio

import pytest

from ferry_operator import cli
from ferry_operator.handlers import crds

LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
ESTABLISHED = {"status": {"conditions": [{"type": "NamesAccepted", "status": "True"},
                                         {"type": "Established", "status": "True"}]}}
NOT_YET = {"status": {"conditions": [{"type": "Established", "status": "False"}]}}


@pytest.fixture(autouse=True)
def fresh_state():
    crds._at_start.clear()
    yield
    crds._at_start.clear()
    crds._stop = None


@pytest.fixture
def kopf_run(monkeypatch):
    import kopf

    import ferry_operator.preflight as preflight

    calls = []
    monkeypatch.setattr(preflight, "check", lambda namespaces: None)
    monkeypatch.setattr(kopf, "run", lambda **kwargs: calls.append(kwargs))
    return calls


def event(body, type_=None):
    asyncio.run(crds.optional_crd_changed(name=LWS_CRD, body=body, type=type_))


@pytest.mark.parametrize("argv,scanning_off", [
    (["run", "--standalone", "--namespace", "ml", "--namespace", "research"], True),
    (["run", "--standalone", "--all-namespaces"], False),
], ids=["named", "all"])
def test_named_namespaces_turn_kopfs_scanning_off(kopf_run, argv, scanning_off):
    assert cli.main(argv) == 0
    (kwargs,) = kopf_run
    assert kwargs["settings"].scanning.disabled is scanning_off
    assert kwargs["clusterwide"] is not scanning_off
    assert isinstance(kwargs["stop_flag"], asyncio.Event) and not kwargs["stop_flag"].is_set()


@pytest.mark.parametrize("pattern", ["ml-*", "!kube-system", "a,b", "ML"])
def test_a_namespace_pattern_is_refused_naming_it(kopf_run, capsys, pattern):
    with pytest.raises(SystemExit):
        cli.main(["run", "--namespace", pattern])
    assert f"{pattern!r} is not a namespace name" in capsys.readouterr().err
    assert not kopf_run


def test_a_stopped_run_starts_again_with_the_same_arguments(kopf_run, monkeypatch):
    import kopf

    execs = []
    monkeypatch.setattr(kopf, "run", lambda stop_flag, **_: stop_flag.set())  # the handler below set it
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: execs.append(argv))
    cli.main(["run", "--standalone", "--namespace", "ml"])
    (argv,) = execs
    assert argv[1:] == ["-m", "ferry_operator.cli", "run", "--standalone", "--namespace", "ml"]


def test_a_crd_missing_at_start_stops_the_operator_once_it_is_established():
    flag = crds.stop_flag()
    assert crds.note_at_start(lambda name: None) == {LWS_CRD: False}
    event(NOT_YET)
    assert not flag.is_set()
    event(ESTABLISHED)
    assert flag.is_set() and crds.restart_asked()


def test_a_crd_established_at_start_stops_the_operator_once_it_is_gone():
    flag = crds.stop_flag()
    assert crds.note_at_start(lambda name: ESTABLISHED) == {LWS_CRD: True}
    event(ESTABLISHED)  # the watch's first listing
    event(ESTABLISHED, "MODIFIED")
    assert not flag.is_set()
    event(ESTABLISHED, "DELETED")
    assert flag.is_set()


def test_a_crd_that_cannot_be_read_at_start_is_settled_by_its_first_event():
    def unreadable(name):
        raise OSError("connection reset")
    flag = crds.stop_flag()
    assert crds.note_at_start(unreadable) == {LWS_CRD: None}
    event(ESTABLISHED)  # the first listing: what kopf's scan saw a moment before; no new start
    assert not flag.is_set()
    event(ESTABLISHED, "DELETED")
    assert flag.is_set()


def test_watching_all_namespaces_nothing_stops():
    flag = crds.stop_flag()  # note_at_start is never called with scanning on: kopf follows CRDs itself
    event(ESTABLISHED)
    event(ESTABLISHED, "DELETED")
    assert not flag.is_set()


def test_the_reader_maps_a_missing_crd_to_none_and_raises_the_rest():
    from kubernetes.client.exceptions import ApiException

    class Api:
        def read_custom_resource_definition(self, name):
            raise ApiException(status=404 if name == LWS_CRD else 500)
    read = crds.reader(Api())
    assert read(LWS_CRD) is None
    with pytest.raises(ApiException):
        read("other")
