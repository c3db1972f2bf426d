"""Benchmark: time to a loaded pod on a warm node (the node cache) against the
same pod reading the artifact from its claim, in one run, on the real node.

    make cluster-up
    .venv/bin/python bench/cache_ready_bench.py [--layers 5] [--tp 2] [--runs 3]

Installs the chart (release ferry-bench, `nodeCache.enabled`, watermarks
large enough for the artifact) so the real node runs the node agent as its
DaemonSet, writes a sharded artifact (bench/shard_bench.py's Llama-3-8B-shaped
checkpoint, `ferry shard`) onto a real local-path claim, fills the node's
cache once with a fill pod (`ferry cache fill-slot` into a CSI fill slot, the
operator's fill Job's command), then times, alternating and each from a cold
page cache:

- **claim**: a pod that mounts the claim read-only and runs what a wired
  serving pod's loader runs (`ferry load --artifact ... --expected-digest`);
- **cache**: the same pod with the node cache's CSI volume (`mode: serve`)
  in place of the claim: the agent verifies the entry at mount, then the
  loader verifies and reads it again.

Each time is from the pod's create call to the loader's exit (pod phase
Succeeded), polled every 0.2 s. Here the claim is on the same local disk as
the cache, so this measures what the cache costs on top of a local read
(mostly the mount's verification); on a cluster the claim is network
storage (an RWX filesystem, or S3) shared by every replica, and that is
what the cache saves. Prints medians and the ratio claim / cache, and
removes everything it made. A benchmark: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "e2e"))
sys.path.insert(0, str(REPO / "bench"))
import localcluster  # noqa: E402
import localnode  # noqa: E402
from cache_bench import remove_tree  # noqa: E402
from cache_state import drop_page_cache  # noqa: E402
from shard_bench import write_checkpoint  # noqa: E402

RELEASE, SYSTEM, NAMESPACE = "ferry-bench", "ferry-bench-system", "ferry-bench"
CLAIM = "bench-weights"
FERRY = Path(sys.executable).with_name("ferry")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=5, help="decoder layers of the Llama-3-8B-shaped checkpoint")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size of the artifact")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--reverify-after", type=int, default=3600, metavar="SECONDS",
                    help="the chart's nodeCache.reverifyAfterSeconds (0: the agent verifies every byte at each mount)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the checkpoint is generated (default: tmp)")
    args = ap.parse_args()

    kube = Kubectl()
    paths = localcluster.node_paths()
    images = localcluster.built_images()
    localcluster.import_images(localnode.Node(paths), images)
    image = images["ferry"]["ref"]
    work = Path(tempfile.mkdtemp(prefix="ferry-ready-bench-", dir=args.workdir))
    cache_root = paths.root / "bench-node-cache"
    try:
        install(kube, paths, image, cache_root, args.reverify_after)
        digest, nbytes = write_artifact(kube, work, args.layers, args.tp, images["busybox"]["ref"])
        print(f"artifact: {nbytes / 1e9:.2f} GB, TP {args.tp}, {digest}", flush=True)
        fill_seconds = run_pod(kube, fill_pod(image, digest, nbytes))
        print(f"fill pod: {fill_seconds:.2f} s (the first pod on a cold node pays this once)", flush=True)
        wait_published(cache_root, digest)
        times: dict[str, list[float]] = {"claim": [], "cache": []}
        for run in range(args.runs):
            for path in ("claim", "cache"):
                drop_page_cache("a cold page cache needs root (the node runs as root here)")
                times[path].append(run_pod(kube, load_pod(image, digest, path, run)))
                print(f"run {run + 1} {path}: {times[path][-1]:.2f} s", flush=True)
        for line in agent_log(kube).splitlines():  # whether each mount verified the entry, in the agent's words
            if "serving (read-only)" in line:
                print("agent:", line.split("serving (read-only) ", 1)[1], flush=True)
        claim, cache = statistics.median(times["claim"]), statistics.median(times["cache"])
        print(json.dumps({"bytes": nbytes, "tp": args.tp, "reverify_after": args.reverify_after, "runs": times, "median_claim_s": round(claim, 2),
                          "median_cache_s": round(cache, 2), "ratio_claim_over_cache": round(claim / cache, 2),
                          "fill_pod_s": round(fill_seconds, 2)}, indent=1))
    finally:
        kube.run("delete", "namespace", NAMESPACE, "--wait=true", "--timeout=180s", check=False)
        subprocess.run([str(localcluster.binaries() / "helm"), "--kubeconfig", str(localcluster.KUBECONFIG),
                        "uninstall", RELEASE, "-n", SYSTEM, "--wait"], capture_output=True)
        kube.run("delete", "namespace", SYSTEM, "--wait=true", "--timeout=180s", check=False)
        shutil.rmtree(work, ignore_errors=True)
        remove_tree(cache_root)
    return 0


class Kubectl:
    def __init__(self):
        self.argv = [localcluster.kubectl_path(), "--kubeconfig", str(localcluster.KUBECONFIG)]

    def run(self, *argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run([*self.argv, *argv], capture_output=True, text=True, input=input)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(argv)}: {proc.stderr.strip()}")
        return proc

    def apply(self, obj: dict) -> None:
        self.run("apply", "-f", "-", input=json.dumps(obj))

    def get(self, *argv: str) -> dict:
        return json.loads(self.run("get", *argv, "-o", "json").stdout)


def install(kube: Kubectl, paths, image: str, cache_root: Path, reverify_after: int) -> None:
    repository, _, tag = image.rpartition(":")
    for ns in (NAMESPACE, SYSTEM):  # an earlier run's may still be going away
        _until(lambda: kube.run("get", "namespace", ns, "-o", "jsonpath={.status.phase}", check=False).stdout
               != "Terminating", f"namespace {ns} gone")
    kube.run("create", "namespace", NAMESPACE, check=False)
    proc = subprocess.run(
        [str(localcluster.binaries() / "helm"), "--kubeconfig", str(localcluster.KUBECONFIG), "upgrade", "--install",
         RELEASE, str(REPO / "charts/ferry"), "--namespace", SYSTEM, "--create-namespace",
         "--set", f"image.repository={repository}", "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never",
         "--set", f"operator.watchNamespaces={{{NAMESPACE}}}", "--set", "operator.resources.requests.cpu=50m",
         "--set", "nodeCache.enabled=true", "--set", f"nodeCache.kubeletDir={paths.kubelet_root}",
         "--set", f"nodeCache.hostPath={cache_root}", "--set", "nodeCache.high=40Gi", "--set", "nodeCache.low=30Gi",
         "--set", "nodeCache.kubeletEvictionHard=1%", "--set", "nodeCache.mountWaitSeconds=5",
         "--set", f"nodeCache.reverifyAfterSeconds={reverify_after}",
         "--wait", "--timeout", "180s"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"helm install {RELEASE}: {proc.stderr.strip()} (another release's nodeCache on this "
                           f"cluster owns the CSIDriver: uninstall it, or run on a fresh `make cluster-up`)")


def write_artifact(kube: Kubectl, work: Path, layers: int, tp: int, busybox: str) -> tuple[str, int]:
    """A claim bound on the real node (a pod binds it), and the sharded artifact written into its directory."""
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM, "namespace": NAMESPACE},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}}}})
    kube.apply(pod("bind", busybox, ["true"], [({"persistentVolumeClaim": {"claimName": CLAIM}}, "/claim", True)]))
    _until(lambda: kube.get("pvc", CLAIM, "-n", NAMESPACE)["status"].get("phase") == "Bound", "the claim bound")
    pv = kube.get("pv", kube.get("pvc", CLAIM, "-n", NAMESPACE)["spec"]["volumeName"])
    claim_dir = Path((pv["spec"].get("hostPath") or pv["spec"].get("local"))["path"])
    kube.run("delete", "pod", "bind", "-n", NAMESPACE, "--wait=false")
    checkpoint = work / "checkpoint"
    write_checkpoint(checkpoint, layers)
    artifact = claim_dir / "artifact"
    subprocess.run([str(FERRY), "shard", "--source", str(checkpoint), "--output", str(artifact),
                    "--tensor-parallel-size", str(tp)], check=True, capture_output=True)
    shutil.rmtree(checkpoint)
    for path in [artifact, *artifact.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # the pods run as a non-root uid
    from ferry_worker.manifest import manifest_digest, read_manifest
    return manifest_digest(artifact), sum(e.size for e in read_manifest(artifact).files)


def pod(name: str, image: str, argv: list[str], volumes: list[tuple[dict, str, bool]]) -> dict:
    """A pod on the real node, as a restricted user, with (volume source, mount path, read-only) volumes."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": localnode.NODE_NAME},
                     "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532},
                     "volumes": [{"name": f"v{i}", **source} for i, (source, _, _) in enumerate(volumes)],
                     "containers": [{"name": "c", "image": image, "imagePullPolicy": "Never", "command": argv,
                                     "volumeMounts": [{"name": f"v{i}", "mountPath": where, "readOnly": ro}
                                                      for i, (_, where, ro) in enumerate(volumes)]}]}}


def claim_volume() -> dict:
    return {"persistentVolumeClaim": {"claimName": CLAIM, "readOnly": True}}


def cache_volume(digest: str, **attributes: str) -> dict:
    return {"csi": {"driver": "cache.ferry.dev", "readOnly": not attributes,
                    "volumeAttributes": {"digest": digest, **attributes}}}


def fill_pod(image: str, digest: str, nbytes: int) -> dict:
    """The operator's fill Job's pod: the claim read-only, the node's fill slot, `ferry cache fill-slot`."""
    return pod("fill", image, ["ferry", "cache", "fill-slot", "--slot", "/slot", "--source", "/claim/artifact",
                               "--digest", digest],
               [(claim_volume(), "/claim", True), (cache_volume(digest, mode="fill", bytes=str(nbytes)), "/slot", False)])


def load_pod(image: str, digest: str, path: str, run: int) -> dict:
    """What a wired serving pod's loader runs, on the claim or on the node's cache entry."""
    volume, where = (claim_volume(), "/weights/artifact") if path == "claim" else (cache_volume(digest), "/weights")
    return pod(f"load-{path}-{run}", image, ["ferry", "load", "--artifact", where, "--expected-digest", digest,
                                             "--no-report"], [(volume, "/weights", True)])


def run_pod(kube: Kubectl, manifest: dict) -> float:
    name = manifest["metadata"]["name"]
    start = time.perf_counter()
    kube.apply(manifest)
    phase = _until(lambda: (p := kube.get("pod", name, "-n", NAMESPACE)["status"].get("phase")) in ("Succeeded",
                                                                                                  "Failed") and p,
                   f"pod {name} done", interval=0.2)
    elapsed = time.perf_counter() - start
    if phase != "Succeeded":
        log = kube.run("logs", name, "-n", NAMESPACE, check=False).stdout[-2000:]
        raise RuntimeError(f"pod {name} failed:\n{log}")
    kube.run("delete", "pod", name, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
    return elapsed


def agent_log(kube: Kubectl) -> str:
    pods = kube.get("pods", "-n", SYSTEM, "-l", "app.kubernetes.io/component=node-cache")["items"]
    (agent,) = [p for p in pods if p["spec"].get("nodeName") == localnode.NODE_NAME]
    return kube.run("logs", agent["metadata"]["name"], "-n", SYSTEM, check=False).stdout


def wait_published(cache_root: Path, digest: str) -> None:
    _until(lambda: (cache_root / "entries" / digest.removeprefix("sha256:")).is_dir(), "the entry published")


def _until(condition, what: str, timeout: float = 900, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what}")


if __name__ == "__main__":
    raise SystemExit(main())
