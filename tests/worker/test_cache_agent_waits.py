"""The node agent's bounded waits, over real gRPC on its unix sockets (the harness of test_cache_agent.py):
pods asking for digests that are absent hold at most MAX_WAITING of the server's threads, so a present
entry still mounts while they are pending. Shares the session's `cache_artifacts` (tests/worker/conftest.py);
the latency itself is bench/'s (bench/cache_mount_bench.py), not asserted here."""
from __future__ import annotations

import threading
import time

import grpc

from ferry_worker.cache.csi.driver import MAX_WAITING
from ferry_worker.cache.csi.proto import csi_pb2
from test_cache_agent import Agent, serve_attrs

VOLUMES = 20  # one pod's inline volumes, each naming a digest no fill brings
OTHER_PODS = MAX_WAITING + 1


def publish_in_thread(agent: Agent, pod: str, volume: str, attrs: dict, outcomes: dict) -> threading.Thread:
    """The kubelet's NodePublishVolume for one volume of `pod`, in a thread; its outcome lands in `outcomes`."""
    target = agent.kubelet / "pods" / pod / "volumes" / "kubernetes.io~csi" / volume / "mount"
    agent.targets.append(target)

    def run() -> None:
        try:
            agent.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
                volume_id=f"csi-{pod}-{volume}", target_path=str(target), readonly=True,
                volume_context={**attrs, "csi.storage.k8s.io/ephemeral": "true",
                                "csi.storage.k8s.io/pod.name": pod, "csi.storage.k8s.io/pod.namespace": "team-b"}))
            outcomes[(pod, volume)] = "mounted"
        except grpc.RpcError as e:
            outcomes[(pod, volume)] = e
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def answered(outcomes: dict, count: int, within_s: float = 60) -> None:
    """Liveness only: without the bound none of these is answered before the agent's 120 s wait."""
    deadline = time.monotonic() + within_s
    while len(outcomes) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_absent_digests_hold_a_bounded_number_of_threads_and_a_present_entry_mounts_meanwhile(
        tmp_path, cache_artifacts):
    agent = Agent(tmp_path, mount_wait=120)
    try:
        present, absent = cache_artifacts["a0"], cache_artifacts["a1"]
        agent.fill("filler", present)
        outcomes: dict = {}
        threads = {("hostile", f"v{i}"): publish_in_thread(agent, "hostile", f"v{i}", serve_attrs(absent), outcomes)
                   for i in range(VOLUMES)}
        answered(outcomes, VOLUMES - 1)  # one waiting publish per pod
        threads.update({(f"pod-{i}", "v0"): publish_in_thread(agent, f"pod-{i}", "v0", serve_attrs(absent), outcomes)
                        for i in range(OTHER_PODS)})
        answered(outcomes, VOLUMES + OTHER_PODS - MAX_WAITING)
        refused = {key: e for key, e in outcomes.items() if isinstance(e, grpc.RpcError)}
        assert len(refused) == VOLUMES + OTHER_PODS - MAX_WAITING, outcomes
        assert all(e.code() == grpc.StatusCode.UNAVAILABLE and "already wait" in e.details() for e in refused.values())
        waiting = [key for key, thread in threads.items() if thread.is_alive()]
        assert len(waiting) == MAX_WAITING and sum(pod == "hostile" for pod, _ in waiting) == 1

        agent.publish("served", serve_attrs(present))  # answered while the waiters still wait
        assert all(threads[key].is_alive() for key in waiting)

        agent.fill("filler-2", absent)  # the entry arrives: each waiter mounts it
        for key in waiting:
            threads[key].join(timeout=60)
        assert {key: outcomes[key] for key in waiting} == {key: "mounted" for key in waiting}
    finally:
        agent.cleanup()
