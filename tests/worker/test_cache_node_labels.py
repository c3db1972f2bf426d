"""The node agent's cache labels, unit level: what it writes for what its
store holds, that it leaves every other label alone, that it follows fills
and evictions, and that it labels nothing unless the admission policy
confining it is enforced. The API server is a fake here (a recording
CoreV1Api); the policy itself is proven on the real API server in
tests/test_node_cache_policy.py, and the labels on the real node in
tests/node/test_node_cache_on_node.py."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from ferry_operator.serving import cache_label
from ferry_worker.cache.node_labels import LABEL_PREFIX, NodeLabeler, label_for, label_patch, wanted_labels
from ferry_worker.cache.store import CacheStore, Watermarks, cache_key
from ferry_worker.manifest import manifest_digest

BIG = Watermarks(high=1 << 40, low=1 << 39)


class FakeNodes:
    """The two node calls the labeller makes, on one node's labels; `deny_probe` is the admission policy."""

    def __init__(self, labels: dict[str, str], deny_probe: bool = True):
        self.labels, self.deny_probe, self.patches = dict(labels), deny_probe, []

    def read_node(self, name):
        return SimpleNamespace(metadata=SimpleNamespace(labels=dict(self.labels)))

    def patch_node(self, name, body, dry_run=None, field_manager=None):
        changes = body["metadata"]["labels"]
        if dry_run:
            if self.deny_probe and any(not k.startswith(LABEL_PREFIX) for k in changes):
                error = ApiException(status=403, reason="Forbidden")
                error.body = ('{"message": "nodes \\"n1\\" is forbidden: ValidatingAdmissionPolicy ... denied request: '
                              'the node cache agent may change only labels under cache.ferry.dev/ on its node"}')
                raise error
            return
        self.patches.append(changes)
        for k, v in changes.items():
            if v is None:
                self.labels.pop(k, None)
            else:
                self.labels[k] = v


def test_the_operator_prefers_exactly_the_label_the_agent_writes():
    d = "sha256:" + "ab" * 32
    assert cache_label(d) == label_for(d)
    name = label_for(d).removeprefix(LABEL_PREFIX)
    assert len(name) == 63 and all(c in "0123456789abcdef" for c in name)  # a label name's limit
    # Not the digest: anyone who may read nodes reads their labels, and the digest is what mounts an entry.
    assert "abab" not in name and label_for("sha256:" + "ab" * 31 + "ac") != label_for(d)


def test_the_patch_adds_and_removes_only_cache_labels():
    other = {"kubernetes.io/hostname": "n1", "cache.ferry.dev/" + "0" * 63: "true", "team": "ml"}
    want = {"cache.ferry.dev/" + "1" * 63}
    assert label_patch(other, want) == {"metadata": {"labels": {
        "cache.ferry.dev/" + "1" * 63: "true", "cache.ferry.dev/" + "0" * 63: None}}}
    assert label_patch({**other, "cache.ferry.dev/" + "1" * 63: "true"} | {"cache.ferry.dev/" + "0" * 63: "true"},
                       {"cache.ferry.dev/" + "0" * 63, "cache.ferry.dev/" + "1" * 63}) is None


def test_labels_follow_fills_and_evictions(tmp_path, cache_artifacts):
    store = CacheStore(tmp_path / "cache", BIG)
    nodes = FakeNodes({"kubernetes.io/hostname": "n1"})
    labeler = NodeLabeler(store, "n1", nodes, period=3600)
    store.on_change = labeler.changed
    a0, a1 = cache_artifacts["a0"], cache_artifacts["a1"]
    store.fill(a0, manifest_digest(a0))
    store.fill(a1, manifest_digest(a1), ranks=[0])  # one rank's entry serves no wired pod: no label
    assert wanted_labels(store) == {label_for(manifest_digest(a0))}
    assert labeler._dirty.is_set()  # the publish asked for a sync

    stop = threading.Event()
    worker = threading.Thread(target=labeler.run, args=(stop,))
    worker.start()
    try:
        _until(lambda: label_for(manifest_digest(a0)) in nodes.labels)
        store.remove(cache_key(manifest_digest(a0)))
        _until(lambda: label_for(manifest_digest(a0)) not in nodes.labels)
    finally:
        stop.set()
        labeler.changed()
        worker.join(5)
    assert nodes.labels == {"kubernetes.io/hostname": "n1"}  # the node's own label untouched throughout
    assert labeler.sync() is None  # nothing left to change


def test_without_the_policy_the_agent_labels_nothing_until_it_is_enforced(tmp_path, cache_artifacts, caplog):
    store = CacheStore(tmp_path / "cache", BIG)
    store.fill(cache_artifacts["a0"], manifest_digest(cache_artifacts["a0"]))
    nodes = FakeNodes({"kubernetes.io/hostname": "n1"}, deny_probe=False)
    labeler = NodeLabeler(store, "n1", nodes, period=0.05)
    stop = threading.Event()
    worker = threading.Thread(target=labeler.run, args=(stop,))
    worker.start()
    try:
        _until(lambda: caplog.text.count("labelling nothing") >= 3)  # asked again and again, writing nothing
        assert nodes.patches == []
        nodes.deny_probe = True  # the policy in force (a new policy takes a moment): labelling starts
        _until(lambda: label_for(manifest_digest(cache_artifacts["a0"])) in nodes.labels)
    finally:
        stop.set()
        labeler.changed()
        worker.join(5)


def test_a_refusal_that_is_not_the_policys_is_not_taken_for_it(tmp_path):
    class RbacRefuses(FakeNodes):
        def patch_node(self, name, body, dry_run=None, field_manager=None):
            raise ApiException(status=403, reason="Forbidden")  # the role binding not in force yet
    labeler = NodeLabeler(CacheStore(tmp_path / "cache", BIG), "n1", RbacRefuses({}), period=3600)
    with pytest.raises(ApiException):
        labeler.policy_enforced()


def _until(condition, timeout: float = 10.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.02)
