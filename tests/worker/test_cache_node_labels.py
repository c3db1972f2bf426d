"""The node agent's cache labels, unit level: what it writes for what its
store holds, that it leaves every other label alone, that it follows fills
and evictions, and that it labels nothing unless the admission policy
confining it is enforced. The API server is a fake here (a recording
CoreV1Api); the policy itself is proven on the real API server in
tests/test_node_cache_policy.py, and the labels on the real node in
tests/node/test_node_cache_on_node.py."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from kubernetes.client.exceptions import ApiException

from file_damage import flip_byte
from ferry_operator.serving.wiring import CACHE_AGENT_LABEL, cache_evicted_label, cache_label
from ferry_worker.cache.node_labels import (AGENT_LABEL, LABEL_PREFIX, NodeLabeler, evicted_label_for, label_for,
                                            label_patch, wanted_labels)
from ferry_worker.cache.store import CORRUPT, REMOVAL_MEMORY_S, CacheStore, Watermarks, cache_key
from ferry_worker.manifest import IntegrityError, manifest_digest

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


def test_the_operator_reads_exactly_the_labels_the_agent_writes():
    d = "sha256:" + "ab" * 32
    assert cache_label(d) == label_for(d)
    assert cache_evicted_label(d) == evicted_label_for(d) and CACHE_AGENT_LABEL == AGENT_LABEL
    assert len(evicted_label_for(d).removeprefix(LABEL_PREFIX)) == 63
    name = label_for(d).removeprefix(LABEL_PREFIX)
    assert len(name) == 63 and all(c in "0123456789abcdef" for c in name)  # a label name's limit
    # Not the digest: anyone who may read nodes reads their labels, and the digest is what mounts an entry.
    assert "abab" not in name and label_for("sha256:" + "ab" * 31 + "ac") != label_for(d)


def test_the_patch_adds_and_removes_only_cache_labels():
    other = {"kubernetes.io/hostname": "n1", "cache.ferry.dev/" + "0" * 63: "true", "team": "ml"}
    want = {"cache.ferry.dev/" + "1" * 63: "true"}
    assert label_patch(other, want) == {"metadata": {"labels": {
        "cache.ferry.dev/" + "1" * 63: "true", "cache.ferry.dev/" + "0" * 63: None}}}
    assert label_patch({**other, "cache.ferry.dev/" + "1" * 63: "true"} | {"cache.ferry.dev/" + "0" * 63: "true"},
                       {"cache.ferry.dev/" + "0" * 63: "true", "cache.ferry.dev/" + "1" * 63: "true"}) is None
    # A value changes in place (a removal's reason and time).
    assert label_patch({"cache.ferry.dev/evicted.x": "lru.1"}, {"cache.ferry.dev/evicted.x": "corrupt.2"}) == {
        "metadata": {"labels": {"cache.ferry.dev/evicted.x": "corrupt.2"}}}


def test_labels_follow_fills_and_evictions(tmp_path, cache_artifacts):
    store = CacheStore(tmp_path / "cache", BIG)
    nodes = FakeNodes({"kubernetes.io/hostname": "n1"})
    labeler = NodeLabeler(store, "n1", nodes, period=3600)
    store.on_change = labeler.changed
    a0, a1 = cache_artifacts["a0"], cache_artifacts["a1"]
    store.fill(a0, manifest_digest(a0))
    store.fill(a1, manifest_digest(a1), ranks=[0])  # one rank's entry serves no wired pod: no label
    assert wanted_labels(store) == {AGENT_LABEL: "true", label_for(manifest_digest(a0)): "true"}
    assert labeler._dirty.is_set()  # the publish asked for a sync

    stop = threading.Event()
    worker = threading.Thread(target=labeler.run, args=(stop,))
    worker.start()
    try:
        _until(lambda: label_for(manifest_digest(a0)) in nodes.labels)
        assert nodes.labels[AGENT_LABEL] == "true"  # the operator may count from these labels
        store.remove(cache_key(manifest_digest(a0)))
        _until(lambda: label_for(manifest_digest(a0)) not in nodes.labels)
        # Why it went, and when, for the operator's Event.
        why, at = nodes.labels[evicted_label_for(manifest_digest(a0))].split(".")
        assert why == "removed" and abs(int(at) - time.time()) < 60
    finally:
        stop.set()
        labeler.changed()
        worker.join(5)
    assert set(nodes.labels) == {"kubernetes.io/hostname", AGENT_LABEL, evicted_label_for(manifest_digest(a0))}
    assert labeler.sync() is None  # nothing left to change


def test_a_removal_is_said_until_it_is_old_or_the_entry_is_back(tmp_path, cache_artifacts):
    store, a0, digest, now = filled_at_a_million(tmp_path, cache_artifacts["a0"])
    victim = flip_byte(sorted(store.entry(cache_key(digest)).glob("*.safetensors"))[0])
    with pytest.raises(IntegrityError, match=victim.name):
        store.mount_entry(cache_key(digest), "pod-1")
    assert wanted_labels(store)[evicted_label_for(digest)] == f"{CORRUPT}.1000000"
    store.fill(a0, digest)  # filled again: the removal is no longer news
    assert evicted_label_for(digest) not in wanted_labels(store)
    store.remove(cache_key(digest))
    assert wanted_labels(store)[evicted_label_for(digest)] == "removed.1000000"
    now[0] += REMOVAL_MEMORY_S + 1
    assert wanted_labels(store) == {AGENT_LABEL: "true"}


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


def filled_at_a_million(tmp_path, artifact):
    """(a store whose clock reads 1e6 until the test moves `now`, the artifact, its digest, now) with the
    artifact filled."""
    now = [1_000_000.0]
    store = CacheStore(tmp_path / "cache", BIG, clock=lambda: now[0])
    digest = manifest_digest(artifact)
    store.fill(artifact, digest)
    return store, artifact, digest, now


def _until(condition, timeout: float = 10.0) -> None:
    import time
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("timed out")
        time.sleep(0.02)


def test_an_entry_found_corrupt_under_its_pods_is_labelled_gone_while_they_still_hold_it(tmp_path, cache_artifacts):
    store, a0, digest, now = filled_at_a_million(tmp_path, cache_artifacts["a0"])
    store.mount_entry(cache_key(digest), "pod-1")
    victim = flip_byte(sorted(store.entry(cache_key(digest)).glob("*.safetensors"))[-1], 0)
    with pytest.raises(IntegrityError, match=victim.name):
        store.check(cache_key(digest))  # an admin's `ferry cache check`, or the scrub
    # Not held any more as far as the node's labels say (no preference, not counted), and why.
    assert wanted_labels(store) == {AGENT_LABEL: "true", evicted_label_for(digest): "corrupt.1000000"}
    now[0] += 30
    store.release(cache_key(digest), "pod-1")  # its pod gone: the entry goes
    assert store.entry(cache_key(digest)) is None
    assert wanted_labels(store) == {AGENT_LABEL: "true", evicted_label_for(digest): "corrupt.1000030"}
