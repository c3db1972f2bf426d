"""A fair, bounded node cache (issue 29): each namespace's entries and fills stay within its share, a fill
past it evicts only that namespace's idle entries or is refused with the numbers (never another
namespace's entry), and a fill slot's reserved room lapses after `reservation_s`. Fills go the fill pod's
way (store.slot, `ferry cache fill-slot`, store.adopt). Shares the session's `cache_artifacts` (three TP 2
sharded_state artifacts, tests/worker/conftest.py) and test_cache_agent.py's agent harness."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from ferry_worker.cache.csi.proto import csi_pb2
from ferry_worker.cache.fill_slot import fill_slot
from ferry_worker.cache.store import CacheError, CacheFull, CacheStore, Fairness, Watermarks, cache_key
from ferry_worker.manifest import manifest_digest, read_manifest
from test_cache_agent import Agent, fill_attrs

BIG = Watermarks(high=1 << 40, low=1 << 39)


def size(artifact: Path) -> int:
    return sum(e.size for e in read_manifest(artifact).files)


def fill_as(store: CacheStore, namespace: str, artifact: Path) -> str:
    """A fill pod of `namespace`: its slot, `ferry cache fill-slot` in it, the agent's adoption."""
    key = cache_key(manifest_digest(artifact))
    slot = store.slot(key, size(artifact), namespace)
    fill_slot(slot, artifact, manifest_digest(artifact), None)
    store.adopt(key, size(artifact))
    return key


def test_a_fill_past_its_namespaces_share_evicts_only_its_own_entries_or_is_refused(tmp_path, cache_artifacts):
    a0, a1, a2 = (cache_artifacts[k] for k in ("a0", "a1", "a2"))
    share = max(size(a0), size(a2)) * 3 // 2  # room for one of team-a's entries, not two
    store = CacheStore(tmp_path / "cache", BIG, fairness=Fairness(namespace_share=share))
    first = fill_as(store, "team-a", a0)
    theirs = fill_as(store, "team-b", a1)
    assert store.namespace_usage("team-a") == size(a0) and store.namespace_usage("team-b") == size(a1)

    second = fill_as(store, "team-a", a2)  # past team-a's share: its own idle entry goes, team-b's stays
    assert store.entry(first) is None and store.entry(theirs) is not None and store.entry(second) is not None

    store.acquire(second, "pod-a")  # team-a's only entry is mounted: nothing of its own can go
    with pytest.raises(CacheFull) as refused:
        store.slot(first, size(a0), "team-a")
    message = str(refused.value)
    assert f"namespace team-a, which holds {size(a2)} of its {share}-byte share" in message
    assert f"needs {size(a0)} more bytes" in message and "nodeCache.namespaceShare" in message
    assert store.entry(theirs) is not None and store.entry(second) is not None  # nobody else's entry went
    assert store.namespace_usage("team-a") == size(a2)  # the refused fill reserved nothing


def test_a_fill_slots_reserved_room_lapses_after_its_deadline(tmp_path, cache_artifacts):
    now = [1000.0]
    store = CacheStore(tmp_path / "cache", BIG, clock=lambda: now[0], fairness=Fairness(reservation_s=600))
    key = cache_key(manifest_digest(cache_artifacts["a0"]))
    store.slot(key, 1 << 30, "team-a")  # declared, nothing written yet
    assert store.usage() == 1 << 30 and store.namespace_usage("team-a") == 1 << 30
    now[0] += 601
    assert store.usage() == 0 and store.namespace_usage("team-a") == 0  # only what the pod wrote counts now


def test_with_a_share_a_fill_volume_without_its_pods_namespace_is_refused(tmp_path, cache_artifacts):
    agent = Agent(tmp_path)
    try:
        agent.store.fairness = Fairness(namespace_share=1 << 30)
        target = agent.kubelet / "pods" / "anon" / "volumes" / "kubernetes.io~csi" / "slot" / "mount"
        with pytest.raises(grpc.RpcError) as refused:
            agent.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id="csi-anon", target_path=str(target), readonly=False,
                volume_context={**fill_attrs(cache_artifacts["a0"]), "csi.storage.k8s.io/ephemeral": "true"}))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "podInfoOnMount" in refused.value.details()
        assert not list((agent.cache / "slots").iterdir())
    finally:
        agent.cleanup()


def test_a_fill_is_held_to_the_bytes_it_declared(tmp_path, cache_artifacts):
    """Room and the namespace's share are held for the declared bytes: a fill whose manifest lists more is
    never published (a forged small size cannot slip a large entry past the share)."""
    store = CacheStore(tmp_path / "cache", BIG, fairness=Fairness(namespace_share=1 << 40))
    artifact = cache_artifacts["a0"]
    key = cache_key(manifest_digest(artifact))
    slot = store.slot(key, size(artifact) // 2, "team-a")
    fill_slot(slot, artifact, manifest_digest(artifact), None)
    with pytest.raises(CacheError, match=f"declared {size(artifact) // 2} bytes and its manifest lists {size(artifact)}"):
        store.adopt(key, size(artifact) // 2)
    assert store.entry(key) is None and store.namespace_usage("team-a") == 0
