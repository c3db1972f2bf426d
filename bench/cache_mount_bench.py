"""Benchmark a present entry's mount while other pods' mounts wait for absent digests, in one run (root).

    .venv/bin/python bench/cache_mount_bench.py [--runs 7] [--absent 20]

The node agent's real gRPC server on a temporary kubelet directory, one entry filled (a small TP 2
sharded_state artifact, `ferry shard`), then, alternating, NodePublishVolume + NodeUnpublishVolume of
that entry:

- baseline: nothing else pending;
- contended: `--absent` volumes of one pod plus `--absent` single-volume pods, all naming a digest no
  fill brings, published just before (each waits at most the agent's mount wait, 5 s here; the
  next baseline starts once they have all been answered).

Before the agent bounded its waits (csi/driver.py MAX_WAITING), each absent publish held one of the
server's 16 threads for the whole wait, and the present mount queued behind them. Reports medians and
the ratio contended / baseline. Everything it writes is removed at the end.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from ferry_worker.cache.csi.agent import sockets, start
from ferry_worker.cache.csi.proto import csi_pb2, csi_pb2_grpc
from ferry_worker.cache.fill_slot import fill_slot
from ferry_worker.cache.store import CacheStore, Watermarks
from ferry_worker.manifest import manifest_digest, read_manifest
from ferry_worker.shard.job import ShardJob

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from checkpoints import LLAMA3, write_checkpoint  # noqa: E402

ABSENT = "sha256:" + "0" * 64
MOUNT_WAIT_S = 5.0


class Kubelet:
    """The kubelet's side of the agent's calls."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.node = csi_pb2_grpc.NodeStub(grpc.insecure_channel(f"unix://{sockets(root)[0]}"))

    def target(self, pod: str, volume: str) -> Path:
        return self.root / "pods" / pod / "volumes" / "kubernetes.io~csi" / volume / "mount"

    def publish(self, pod: str, volume: str, attrs: dict) -> None:
        self.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
            volume_id=f"csi-{pod}-{volume}", target_path=str(self.target(pod, volume)), readonly=True,
            volume_context={**attrs, "csi.storage.k8s.io/ephemeral": "true", "csi.storage.k8s.io/pod.name": pod,
                            "csi.storage.k8s.io/pod.namespace": "bench"}), timeout=120)

    def unpublish(self, pod: str, volume: str) -> None:
        self.node.NodeUnpublishVolume(csi_pb2.NodeUnpublishVolumeRequest(
            volume_id=f"csi-{pod}-{volume}", target_path=str(self.target(pod, volume))))

    def fill(self, artifact: Path) -> str:
        digest = manifest_digest(artifact)
        size = sum(e.size for e in read_manifest(artifact).files)
        self.publish("filler", "slot", {"digest": digest, "mode": "fill", "bytes": str(size)})
        fill_slot(self.target("filler", "slot"), artifact, digest, None)
        self.unpublish("filler", "slot")
        return digest


def absent_publishes(kubelet: Kubelet, count: int) -> list[threading.Thread]:
    """`count` volumes of one pod and `count` one-volume pods, each asking for a digest no fill brings."""
    names = [("hostile", f"v{i}") for i in range(count)] + [(f"pod-{i}", "v0") for i in range(count)]

    def run(pod: str, volume: str) -> None:
        try:
            kubelet.publish(pod, volume, {"digest": ABSENT})
        except grpc.RpcError:
            pass  # refused at once, or after the wait: either way Unavailable, the kubelet retries
    threads = [threading.Thread(target=run, args=name, daemon=True) for name in names]
    for thread in threads:
        thread.start()
    time.sleep(0.5)  # let them reach the agent
    return threads


def mount_once(kubelet: Kubelet, digest: str, run: int) -> float:
    start_at = time.perf_counter()
    kubelet.publish(f"served-{run}", "weights", {"digest": digest})
    elapsed = time.perf_counter() - start_at
    kubelet.unpublish(f"served-{run}", "weights")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--absent", type=int, default=20)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ferry-mount-bench-"))
    kubelet_dir = Path(tempfile.mkdtemp(prefix="kubelet-", dir="/tmp"))  # a socket path is short
    try:
        write_checkpoint(work / "ckpt", LLAMA3, seed=0)
        ShardJob.prepare(work / "ckpt", work / "artifact", tp=2).run()
        server = start(CacheStore(work / "cache", Watermarks(high=1 << 40, low=1 << 39)), kubelet_dir, "bench", MOUNT_WAIT_S)
        kubelet = Kubelet(kubelet_dir)
        digest = kubelet.fill(work / "artifact")
        times: dict[str, list[float]] = {"baseline": [], "contended": []}
        for run in range(args.runs):
            times["baseline"].append(mount_once(kubelet, digest, 2 * run))
            waiting = absent_publishes(kubelet, args.absent)
            times["contended"].append(mount_once(kubelet, digest, 2 * run + 1))
            print(f"  run {run}: baseline {times['baseline'][-1] * 1e3:.1f} ms, contended "
                  f"{times['contended'][-1] * 1e3:.1f} ms ({sum(t.is_alive() for t in waiting)} absent still waiting)",
                  flush=True)
            for thread in waiting:
                thread.join(MOUNT_WAIT_S + 60)
        base, contended = (statistics.median(times[k]) for k in ("baseline", "contended"))
        print(f"present-entry mount, median of {args.runs}: baseline {base * 1e3:.1f} ms, with {2 * args.absent} "
              f"absent-digest mounts pending {contended * 1e3:.1f} ms (ratio {contended / base:.2f})")
        server.stop(grace=None).wait()
    finally:
        for mount in sorted(kubelet_dir.rglob("mount"), reverse=True):
            subprocess_unmount(mount)
        shutil.rmtree(kubelet_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


def subprocess_unmount(path: Path) -> None:
    from ferry_worker.cache.csi import mounts

    if mounts.is_mount(path):
        mounts.unmount(path)


if __name__ == "__main__":
    sys.exit(main())
