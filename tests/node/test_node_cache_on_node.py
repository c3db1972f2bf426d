"""The node cache on the real node (issue 17): the chart's agent registered
with the real kubelet as the CSI driver cache.ferry.dev, fill pods filling
entries from a real claim, serving pods in a Pod Security `restricted`
namespace mounting them read-only with no claim of their own, a flipped byte
refused by the kubelet's mount with the file named, the agent SIGKILLed while
a fill pod holds its slot, and eviction under the chart's small watermarks.

The artifact is a real TP 2 sharded_state artifact the chart's operator
prepared from the S3 server; a second one (another checkpoint) is written
onto the same claim so that three entries of one size exist. The last test
is the user's path: a ModelWeights with serving.nodeCache, the operator
prewarming the node, wiring the Deployment and running its fill Jobs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

import localcluster
import localnode
from checkpoints import LLAMA3, write_checkpoint
from cluster_support import wait_for
from file_damage import flip_byte
from ferry_worker.cache.node_labels import evicted_label_for, label_for
from ferry_worker.cache.store import cache_key
from ferry_worker.load.selection import select
from ferry_worker.manifest import manifest_digest, read_manifest
from ferry_worker.shard.job import ShardJob
from node_support import (CHART, HOSTILE_KEYS, NAMESPACE, NODE_CACHE_HIGH, NODE_CACHE_LOW, assert_no_hostile_env, claim_dir,
                          condition, helm, modelweights, mw_status, pods_of, s3_secret, standin_deployment,
                          unique, upload_dir, wait_ready, wait_stalled)

pytestmark = [pytest.mark.cluster, pytest.mark.node]
DRIVER = "cache.ferry.dev"
RESTRICTED_NS = "cache-restricted"
POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@dataclass(frozen=True)
class Artifact:
    claim: str
    path: str  # on the claim
    host: Path  # the same directory, seen from the host

    @property
    def digest(self) -> str:
        return manifest_digest(self.host)

    def key(self, ranks: list[int] | None = None) -> str:
        return cache_key(self.digest, ranks)

    def nbytes(self, ranks: list[int] | None = None) -> int:
        return sum(e.size for e in select(read_manifest(self.host), ranks).entries)


def cache_dir() -> Path:
    """The agent's cache on the host (the chart's nodeCache.hostPath; see conftest)."""
    return localcluster.node_paths().root / "node-cache"


@pytest.fixture(scope="module")
def artifacts(node, chart_operator, node_s3, checkpoint, tmp_path_factory) -> dict[str, Artifact]:
    name = unique("cached")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    node.apply(modelweights(name, f"s3://{name}/tiny-llama",
                            {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"},
                            secret=f"{name}-s3"))
    status = wait_ready(node, NAMESPACE, name)
    claim, _, path = status["artifact"]["uri"].removeprefix("pvc://").partition("/")
    a = Artifact(claim, path, claim_dir(node, claim) / path)
    assert a.digest == status["artifact"]["manifestDigest"]
    # A second artifact on the same claim: another checkpoint, sharded here, readable by the pods' uid.
    other = tmp_path_factory.mktemp("other") / "ckpt"
    write_checkpoint(other, LLAMA3, seed=7)
    b_host = claim_dir(node, claim) / "other-artifact"
    ShardJob.prepare(other, b_host, tp=2).run()
    for p in [b_host, *b_host.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    b = Artifact(claim, "other-artifact", b_host)
    # The chart's watermarks are sized for these: two one-rank entries fit under the high mark, three do not.
    one_rank = max(a.nbytes([0]), a.nbytes([1]), b.nbytes([0]))
    assert 2 * one_rank <= NODE_CACHE_LOW < NODE_CACHE_HIGH < 3 * min(a.nbytes([0]), b.nbytes([0]))
    assert a.nbytes() <= NODE_CACHE_HIGH
    node.kubectl("create", "namespace", RESTRICTED_NS, check=False)
    node.kubectl("label", "--overwrite", "namespace", RESTRICTED_NS, "pod-security.kubernetes.io/enforce=restricted")
    yield {"a": a, "b": b}
    node.kubectl("delete", "namespace", RESTRICTED_NS, "--wait=false", check=False)


# -- pods ------------------------------------------------------------------------------------------------------
def fill_pod(kube, image: str, name: str, art: Artifact, ranks: list[int] | None = None,
             barrier: str | None = None) -> str:
    """A fill pod as the operator will launch it: the claim read-only with the pod's own rights, the slot
    from the agent, `ferry cache fill-slot`. With `barrier`, it waits for that file on the claim first."""
    attrs = {"digest": art.digest, "mode": "fill", "bytes": str(art.nbytes(ranks))}
    command = f"ferry cache fill-slot --slot /slot --source /claim/{art.path} --digest {art.digest}"
    if ranks is not None:
        attrs["ranks"] = ",".join(map(str, ranks))
        command += f" --ranks {attrs['ranks']}"
    if barrier:
        command = f"echo waiting; until [ -e /claim/{barrier} ]; do sleep 0.2; done; {command}"
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {
        "restartPolicy": "Never", "securityContext": POD_SECURITY, "automountServiceAccountToken": False,
        "containers": [{"name": "fill", "image": image, "imagePullPolicy": "Never", "command": ["sh", "-c", command],
                        "securityContext": CONTAINER_SECURITY,
                        "volumeMounts": [{"name": "claim", "mountPath": "/claim", "readOnly": True},
                                         {"name": "slot", "mountPath": "/slot"}]}],
        "volumes": [{"name": "claim", "persistentVolumeClaim": {"claimName": art.claim, "readOnly": True}},
                    {"name": "slot", "csi": {"driver": DRIVER, "volumeAttributes": attrs}}]}})
    return name


def serve_pod(kube, name: str, art: Artifact, ranks: list[int] | None = None) -> str:
    """A serving pod in the restricted namespace: no claim, only the entry, read-only."""
    attrs = {"digest": art.digest, **({"ranks": ",".join(map(str, ranks))} if ranks is not None else {})}
    busybox = localcluster.built_images()["busybox"]["ref"]
    script = ("cat /weights/ferry-manifest.json > /dev/null || exit 1; "
              "if touch /weights/probe 2>/dev/null; then echo WRITABLE; else echo READ-ONLY; fi; exec sleep 3600")
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": RESTRICTED_NS}, "spec": {
        "securityContext": POD_SECURITY, "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "serve", "image": busybox, "imagePullPolicy": "Never", "command": ["sh", "-c", script],
                        "securityContext": CONTAINER_SECURITY,
                        "volumeMounts": [{"name": "weights", "mountPath": "/weights", "readOnly": True}]}],
        "volumes": [{"name": "weights", "csi": {"driver": DRIVER, "readOnly": True, "volumeAttributes": attrs}}]}})
    return name


def phase(kube, namespace: str, name: str) -> str:
    return kube.kubectl("get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}", check=False).stdout


def wait_phase(kube, namespace: str, name: str, wanted: str, timeout: float = 120) -> None:
    def reached():
        now = phase(kube, namespace, name)
        if now == "Failed" and wanted != "Failed":
            logs = kube.kubectl("logs", name, "-n", namespace, check=False).stdout
            raise AssertionError(f"pod {name} failed:\n{logs}")
        return now == wanted
    wait_for(reached, f"pod {namespace}/{name} {wanted}", timeout)


def mount_failures(kube, namespace: str, name: str) -> list[str]:
    events = kube.get_json("events", "-n", namespace, "--field-selector",
                           f"involvedObject.name={name},reason=FailedMount")["items"]
    return [e["message"] for e in events]


def delete_pods(kube, namespace: str, *names: str) -> None:
    kube.kubectl("delete", "pod", *names, "-n", namespace, "--wait=true", "--timeout=90s", check=False, timeout=120)


def agent_pod(kube, namespace: str) -> dict:
    """The agent's pod on the real node (kwok's GPU nodes get one too: the DaemonSet tolerates every taint;
    a pod being replaced is left out)."""
    def one():
        pods = [p for p in kube.get_json("pods", "-n", namespace)["items"] if not p["metadata"].get("deletionTimestamp")
                and p["spec"].get("nodeName") == localnode.NODE_NAME and any(o["kind"] == "DaemonSet" and o["name"].endswith("-node-cache")
                        for o in p["metadata"].get("ownerReferences", []))]
        return pods[0] if len(pods) == 1 else None
    return wait_for(one, "the node cache agent's pod", timeout=120)


def in_agent(kube, namespace: str, *action: str, check: bool = True):
    """An admin's `ferry cache ACTION ...` run in the agent's pod, on the agent's own cache (its --root and
    watermarks: the agent's command up to `agent`)."""
    agent = agent_pod(kube, namespace)
    (container,) = agent["spec"]["containers"]
    store_command = container["command"][:container["command"].index("agent")]
    return kube.kubectl("exec", agent["metadata"]["name"], "-n", namespace, "--", *store_command, *action,
                        check=check)


def agent_log(kube, namespace: str, previous: bool = False) -> str:
    name = agent_pod(kube, namespace)["metadata"]["name"]
    return kube.kubectl("logs", name, "-n", namespace, *(["--previous"] if previous else []), check=False).stdout


def published(key: str) -> bool:
    return (cache_dir() / "entries" / key).is_dir()


def clear_cache() -> None:
    """Every unmounted entry removed, as `ferry cache evict --digest` would (from the host: the test owns it)."""
    for entry in (cache_dir() / "entries").iterdir():
        if not any((cache_dir() / "holders" / entry.name).glob("*")):
            for p in [entry, *entry.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
            shutil.rmtree(entry)
            (cache_dir() / "meta" / f"{entry.name}.json").unlink(missing_ok=True)


# -- a tenant's attack on the node (issue 29) ---------------------------------------------------------------
# Code a tenant plants on her own claim, for the PYTHONPATH/LD_PRELOAD keys of her Secret (HOSTILE_KEYS). Were
# it ever run in a prepare pod, it would say so (a marker on the claim and a line on stderr) and, at exit, add an
# entry to every manifest under /weights naming the canary in another pod's emptyDir on the node, by an absolute
# path and by a `..` path: the entries the root agent's slot adoption would once have unlinked.
SITECUSTOMIZE = """\
import atexit, glob, json, os, sys
open("/weights/evil/RAN", "w").write("ran")
print("EVIL CODE RAN", file=sys.stderr)
def _poison():
    for m in glob.glob("/weights/**/ferry-manifest.json", recursive=True):
        try:
            doc = json.load(open(m))
            for path in (CANARY, "../" * 24 + CANARY.lstrip("/")):
                doc["files"].append({"path": path, "size": 7, "sha256": "0" * 64})
            json.dump(doc, open(m, "w"))
        except Exception:
            pass
atexit.register(_poison)
"""


def victim_canary(kube, namespace: str) -> tuple[str, Path]:
    """Another team's pod on the node with a canary file in its emptyDir: (its name, the file on the host)."""
    name = unique("victim")
    kube.kubectl("create", "namespace", namespace, check=False)
    busybox = localcluster.built_images()["busybox"]["ref"]
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace}, "spec": {
        "securityContext": POD_SECURITY, "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
        "containers": [{"name": "victim", "image": busybox, "imagePullPolicy": "Never", "securityContext":
                        CONTAINER_SECURITY, "command": ["sh", "-c", "echo canary > /scratch/canary; exec sleep 3600"],
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}],
        "volumes": [{"name": "scratch", "emptyDir": {}}]}})
    wait_phase(kube, namespace, name, "Running")
    uid = kube.get_json("pod", name, "-n", namespace)["metadata"]["uid"]
    canary = localcluster.node_paths().kubelet_root / "pods" / uid / "volumes" / "kubernetes.io~empty-dir" / "scratch"
    wait_for(lambda: (canary / "canary").is_file(), "the victim's canary written")
    return name, canary / "canary"


def tenant_claim_with_code(kube, claim: str, canary: Path) -> None:
    """The tenant's own claim, with SITECUSTOMIZE and a bogus preload library planted by her own pod."""
    kube.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": NAMESPACE},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    code = f"CANARY = {str(canary)!r}\n{SITECUSTOMIZE}"
    script = ('mkdir -p /weights/evil && cat > /weights/evil/sitecustomize.py <<"PY"\n' + code + 'PY\n'
              'echo "not an ELF object" > /weights/evil/hook.so')
    busybox = localcluster.built_images()["busybox"]["ref"]
    planter = unique("planter")
    kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": planter, "namespace": NAMESPACE}, "spec": {
        "restartPolicy": "Never", "securityContext": POD_SECURITY, "automountServiceAccountToken": False,
        "containers": [{"name": "plant", "image": busybox, "imagePullPolicy": "Never", "command": ["sh", "-c", script],
                        "securityContext": CONTAINER_SECURITY,
                        "volumeMounts": [{"name": "weights", "mountPath": "/weights"}]}],
        "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": claim}}]}})
    wait_phase(kube, NAMESPACE, planter, "Succeeded")
    delete_pods(kube, NAMESPACE, planter)


# -- tests -----------------------------------------------------------------------------------------------------
def test_the_kubelet_registers_the_agent_as_a_csi_driver(node, chart_operator):
    def registered():
        csinode = node.get_json("csinode", localnode.NODE_NAME)
        return [d for d in csinode["spec"].get("drivers") or [] if d["name"] == DRIVER]
    (driver,) = wait_for(registered, f"the CSINode to list {DRIVER}", timeout=120)
    assert driver["nodeID"] == localnode.NODE_NAME
    # Its token (for its node's cache labels) is the kubelet's projected, pod-bound one (the labels it
    # writes through the policy are asserted on the user's path below).
    pod = agent_pod(node, chart_operator["namespace"])
    assert any(s.get("serviceAccountToken") for v in pod["spec"]["volumes"]
               for s in (v.get("projected") or {}).get("sources", []))
    log = agent_log(node, chart_operator["namespace"])
    assert "no service account token" not in log, log


def test_one_fill_serves_two_restricted_pods_read_only(node, chart_operator, artifacts):
    a, key = artifacts["a"], artifacts["a"].key()
    clear_cache()
    filler = fill_pod(node, chart_operator["image"], unique("fill"), a)
    wait_phase(node, NAMESPACE, filler, "Succeeded")
    wait_for(lambda: published(key), "the agent to publish the entry once the fill pod ended", timeout=60)
    inode = (cache_dir() / "entries" / key).stat().st_ino
    pods = [serve_pod(node, unique("serve"), a) for _ in range(2)]
    for pod in pods:
        wait_phase(node, RESTRICTED_NS, pod, "Running")
        wait_for(lambda: "READ-ONLY" in node.kubectl("logs", pod, "-n", RESTRICTED_NS, check=False).stdout,
                 f"{pod} to find its weights read-only")
    assert (cache_dir() / "entries" / key).stat().st_ino == inode  # the same entry, not filled again
    assert sorted(p.name for p in (cache_dir() / "holders" / key).iterdir()).__len__() == 2
    log = agent_log(node, chart_operator["namespace"])
    assert sum(f"fill slot of {key}" in line for line in log.splitlines()) == 1, log
    for pod in pods:
        assert f"serving (read-only) {key} for pod {RESTRICTED_NS}/{pod}" in log
    delete_pods(node, RESTRICTED_NS, *pods)
    wait_for(lambda: not any((cache_dir() / "holders" / key).iterdir()), "the entry released by both pods")


def test_a_flipped_byte_fails_the_mount_naming_the_file_until_refilled(node, chart_operator, artifacts):
    a, key = artifacts["a"], artifacts["a"].key([1])
    clear_cache()
    wait_phase(node, NAMESPACE, fill_pod(node, chart_operator["image"], unique("fill"), a, [1]), "Succeeded")
    wait_for(lambda: published(key), "the entry published")
    victim = cache_dir() / "entries" / key / "model-rank-1-part-0.safetensors"
    victim.chmod(0o644)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    pod = serve_pod(node, unique("serve"), a, [1])
    messages = wait_for(lambda: [m for m in mount_failures(node, RESTRICTED_NS, pod)
                                 if "model-rank-1-part-0.safetensors" in m], "a FailedMount naming the file")
    assert "corrupt" in messages[0] and "DataLoss" in messages[0], messages
    assert phase(node, RESTRICTED_NS, pod) == "Pending" and not published(key)
    wait_phase(node, NAMESPACE, fill_pod(node, chart_operator["image"], unique("refill"), a, [1]), "Succeeded")
    wait_phase(node, RESTRICTED_NS, pod, "Running", timeout=180)  # the kubelet's retry finds the new entry
    delete_pods(node, RESTRICTED_NS, pod)


def test_an_agent_killed_while_a_fill_pod_holds_its_slot_adopts_the_fill(node, chart_operator, artifacts):
    a, key = artifacts["a"], artifacts["a"].key([0])
    namespace = chart_operator["namespace"]
    clear_cache()
    barrier = unique("go")
    filler = fill_pod(node, chart_operator["image"], unique("fill"), a, [0], barrier=barrier)
    try:
        # The barrier holds: the slot is mounted and the pod's container runs, waiting for the barrier file
        # (the mount's log line alone comes before the container starts).
        wait_for(lambda: f"fill slot of {key} for pod {NAMESPACE}/{filler}" in agent_log(node, namespace),
                 "the fill pod's slot mounted", timeout=120)
        wait_phase(node, NAMESPACE, filler, "Running")
        wait_for(lambda: "waiting" in node.kubectl("logs", filler, "-n", NAMESPACE, check=False).stdout,
                 "the fill pod at its barrier")
        before = agent_pod(node, namespace)
        restarts = before["status"]["containerStatuses"][0]["restartCount"]
        (pid,) = [p for p in localnode.pids_mentioning("--node-name") if " cache " in f" {localnode._cmdline(p)} "
                  and " agent " in f" {localnode._cmdline(p)} "]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), "the agent to die")
        # The kill landed while the slot was held: the pod is still at its barrier, nothing is published.
        assert phase(node, NAMESPACE, filler) == "Running" and not published(key)
        (claim_dir(node, a.claim) / barrier).touch()
        wait_phase(node, NAMESPACE, filler, "Succeeded")
        wait_for(lambda: agent_pod(node, namespace)["status"]["containerStatuses"][0]["restartCount"] > restarts,
                 "the DaemonSet to restart the agent", timeout=120)
        wait_for(lambda: published(key), "the restarted agent to adopt the fill", timeout=120)
        pod = serve_pod(node, unique("serve"), a, [0])
        wait_phase(node, RESTRICTED_NS, pod, "Running", timeout=180)
        assert f"published {key} from the fill of pod {NAMESPACE}/{filler}" in agent_log(node, namespace)
        delete_pods(node, RESTRICTED_NS, pod)
    finally:  # a fill pod left at its barrier would hold its slot (and its room) through the next tests
        delete_pods(node, NAMESPACE, filler)
        (claim_dir(node, a.claim) / barrier).unlink(missing_ok=True)


def test_eviction_is_lru_spares_mounted_entries_and_refuses_what_cannot_fit(node, chart_operator, artifacts):
    a, b = artifacts["a"], artifacts["b"]
    image, namespace = chart_operator["image"], chart_operator["namespace"]
    clear_cache()
    # Its serving pods and the blocked fill go however the test ends: no mount or slot outlives it.
    made: list[tuple[str, str]] = []
    try:
        for ranks in ([0], [1]):  # a.r0 then a.r1: two entries, under the high mark
            wait_phase(node, NAMESPACE, fill_pod(node, image, unique("fill"), a, ranks), "Succeeded")
            wait_for(lambda: published(a.key(ranks)), "the entry published")
        holder = serve_pod(node, unique("serve"), a, [0])  # a.r0 mounted: now the most recently used, and held
        made.append((RESTRICTED_NS, holder))
        wait_phase(node, RESTRICTED_NS, holder, "Running")
        # b.r0 does not fit beside both: the least recently used unmounted entry (a.r1) goes, a.r0 stays.
        wait_phase(node, NAMESPACE, fill_pod(node, image, unique("fill"), b, [0]), "Succeeded")
        wait_for(lambda: published(b.key([0])), "the third entry published")
        assert published(a.key([0])) and not published(a.key([1]))
        assert f"evicted {a.key([1])}" in agent_log(node, namespace)
        # With both remaining entries mounted, nothing can go: the fill pod's mount is refused with the reason.
        second = serve_pod(node, unique("serve"), b, [0])
        made.append((RESTRICTED_NS, second))
        wait_phase(node, RESTRICTED_NS, second, "Running")
        blocked = fill_pod(node, image, unique("fill"), a, [1])
        made.append((NAMESPACE, blocked))
        messages = wait_for(lambda: mount_failures(node, NAMESPACE, blocked), "the blocked fill's FailedMount")
        assert "ResourceExhausted" in messages[0] and "high watermark" in messages[0], messages
        assert phase(node, NAMESPACE, blocked) == "Pending" and published(a.key([0])) and published(b.key([0]))
        pressure = node.kubectl("get", "node", localnode.NODE_NAME, "-o",
                                'jsonpath={.status.conditions[?(@.type=="DiskPressure")].status}').stdout
        assert pressure == "False"
    finally:
        for ns, name in made:
            delete_pods(node, ns, name)


def set_namespace_share(kube, chart: dict, share: str) -> None:
    """`helm upgrade` of the session's chart with nodeCache.namespaceShare=`share`, the agent rolled to it."""
    proc = helm("upgrade", chart["release"], str(CHART), "--namespace", chart["namespace"], "--reuse-values",
                "--set-string", f"nodeCache.namespaceShare={share}", "--wait", "--timeout", "180s", check=False)
    assert proc.returncode == 0, proc.stderr
    wait_for(lambda: f"--namespace-share {share}" in " ".join(agent_pod(kube, chart["namespace"])["spec"][
        "containers"][0]["command"]) and agent_ready(kube, chart["namespace"]), f"the agent with share {share}")


def agent_ready(kube, namespace: str) -> bool:
    return all(c.get("ready") for c in agent_pod(kube, namespace)["status"].get("containerStatuses") or [{}])


def test_one_namespaces_fill_past_its_share_is_refused_and_anothers_entry_survives(node, chart_operator, artifacts):
    """Two namespaces, each with its share of the node's cache (nodeCache.namespaceShare, the chart's value,
    set for this test). The watched namespace holds an idle one-rank entry; a pod of another namespace declares a
    fill larger than its share. The agent refuses that mount, naming the namespace and its share, and the first
    namespace's entry stays. Without the share it would have gone: the declared bytes plus the entry pass the
    high watermark, and an idle entry is what the cache evicts to make room."""
    a = artifacts["a"]
    image, namespace = chart_operator["image"], chart_operator["namespace"]
    share, oversized = a.nbytes([0]) + 100_000, NODE_CACHE_HIGH - a.nbytes([0]) + 100_000
    assert oversized > share and oversized + a.nbytes([0]) > NODE_CACHE_HIGH >= oversized
    clear_cache()
    made: list[tuple[str, str]] = []
    try:
        set_namespace_share(node, chart_operator, str(share))
        wait_phase(node, NAMESPACE, fill_pod(node, image, unique("fill"), a, [0]), "Succeeded")
        wait_for(lambda: published(a.key([0])), "the watched namespace's entry published")
        # The other namespace's fill: its pod declares the bytes (a tenant's own pod can say anything); the
        # agent decides at the mount, before a byte moves, so the pod needs no source.
        hog = unique("hog")
        made.append((RESTRICTED_NS, hog))
        attrs = {"digest": artifacts["b"].digest, "mode": "fill", "bytes": str(oversized)}
        node.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": hog, "namespace": RESTRICTED_NS}, "spec": {
            "restartPolicy": "Never", "securityContext": POD_SECURITY, "automountServiceAccountToken": False,
            "containers": [{"name": "fill", "image": image, "imagePullPolicy": "Never", "command": ["sh", "-c", "true"],
                            "securityContext": CONTAINER_SECURITY,
                            "volumeMounts": [{"name": "slot", "mountPath": "/slot"}]}],
            "volumes": [{"name": "slot", "csi": {"driver": DRIVER, "volumeAttributes": attrs}}]}})
        messages = wait_for(lambda: mount_failures(node, RESTRICTED_NS, hog), "the oversized fill's FailedMount")
        assert "ResourceExhausted" in messages[0] and f"namespace {RESTRICTED_NS}" in messages[0], messages
        assert f"{share}-byte share" in messages[0], messages
        assert phase(node, RESTRICTED_NS, hog) == "Pending" and published(a.key([0]))
        assert f"evicted {a.key([0])}" not in agent_log(node, namespace)
    finally:
        for ns, name in made:
            delete_pods(node, ns, name)
        set_namespace_share(node, chart_operator, "50%")  # the chart's default, which the session installs


def test_a_wired_deployment_serves_from_the_node_cache_and_a_new_artifact_is_prewarmed(node, chart_operator,
                                                                                      node_s3, checkpoint):
    """serving.nodeCache through the chart's operator. The wired pod waits for its entry, and the operator
    fills its node (a fill Job), so it passes the loader's gate with the entry mounted read-only; a second
    replica on the same node mounts the same entry with no second fill. Then a new artifact (TP 2 -> 1)
    with a prewarm of the node: the entry is on the node before the Deployment is patched.

    The tenant plays the PYTHONPATH attack of issue 29 along the way: her Secret carries PYTHONPATH and
    LD_PRELOAD keys naming code she planted on her own claim (storage.pvc.name), code that would poison the
    artifact's manifest with another pod's emptyDir canary for the root agent to adopt. No Job pod sees those
    variables, the code never runs, and the canary survives the fills and the agent's adoption and eviction."""
    name, victim = unique("nodecache"), None
    clear_cache()
    try:
        victim, canary = victim_canary(node, RESTRICTED_NS)
        tenant_claim_with_code(node, f"{name}-own", canary)
        upload_dir(node_s3, name, "tiny-llama", checkpoint)
        s3_secret(node, NAMESPACE, f"{name}-s3", node_s3, extra=HOSTILE_KEYS)
        standin_deployment(node, name)
        mw = modelweights(name, f"s3://{name}/tiny-llama",
                          {"type": "sharded_state", "tensorParallelSize": 2, "vllmVersion": "0.32"},
                          secret=f"{name}-s3")
        mw["spec"]["storage"]["pvc"] = {"name": f"{name}-own"}  # her own claim, reused
        mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}],
                                 "nodeCache": {"enabled": True}}
        node.apply(mw)
        digest = wait_ready(node, NAMESPACE, name, timeout=420)["artifact"]["manifestDigest"]
        assert_no_hostile_env(node, name)
        planted = claim_dir(node, f"{name}-own") / "evil"
        assert (planted / "sitecustomize.py").is_file() and not (planted / "RAN").exists()
        # Warm once a fill round's pod found the entry published (the round after the one that filled it).
        cache = wait_for(lambda: (c := mw_status(node, NAMESPACE, name).get("cache") or {}).get("summary") == "1"
                         and c, "the node counted warm", timeout=120)
        assert cache["nodes"] == [localnode.NODE_NAME] and cache["digest"] == digest, cache
        template = node.get_json("deployment", name, "-n", NAMESPACE)["spec"]["template"]["spec"]
        volume = next(v for v in template["volumes"] if v["name"] == "ferry-weights")
        assert volume == {"name": "ferry-weights", "csi": {"driver": DRIVER, "readOnly": True,
                                                           "volumeAttributes": {"digest": digest}}}, volume
        row = node.kubectl("get", "mw", name, "-n", NAMESPACE).stdout.splitlines()
        assert row[1].split()[row[0].split().index("CACHED")] == "1"
        # The agent labels its node with what it holds (through the chart's policy), and the wired pods
        # prefer nodes with that label: preferred, not required, so compute still decides.
        wait_for(lambda: node_labels(node).get(label_for(digest)) == "true", "the agent's label on the node")
        assert template["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
            {"weight": 50, "preference": {"matchExpressions": [{"key": label_for(digest), "operator": "Exists"}]}}]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in template["affinity"]["nodeAffinity"]
        assert len(fill_jobs(node, name)) == 1  # only the latest round is kept

        # A second replica on the same node: the same entry, no second fill.
        node.kubectl("scale", f"deployment/{name}", "-n", NAMESPACE, "--replicas=2")
        wait_for(lambda: (mw_status(node, NAMESPACE, name).get("loaded") or {}).get("summary") == "2/2",
                 "both replicas loaded", timeout=240)
        pods = [p["metadata"]["name"] for p in pods_of(node, name) if not p["metadata"].get("deletionTimestamp")]
        assert len(pods) == 2
        log = agent_log(node, chart_operator["namespace"])
        assert sum(f"fill slot of {cache_key(digest)}" in line for line in log.splitlines()) == 1, log
        for pod in pods:
            assert f"serving (read-only) {cache_key(digest)} for pod {NAMESPACE}/{pod}" in log
            # Loaded is the init container's word; the serving container starts a moment later.
            wait_for(lambda: any(c["name"] == "vllm" and "running" in (c.get("state") or {}) for c in node.get_json(
                "pod", pod, "-n", NAMESPACE)["status"].get("containerStatuses") or []), f"{pod}'s vllm running")
            refused = node.kubectl("exec", pod, "-n", NAMESPACE, "-c", "vllm", "--", "touch", "/ferry/weights/x",
                                   check=False)
            assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused.stderr

        # A new artifact, prewarmed: the Deployment is patched only once the node holds it. The chart's
        # watermarks hold one whole artifact: the old one must be unmounted (no replicas) to make room, as
        # the agent refuses to evict a mounted entry.
        node.kubectl("scale", f"deployment/{name}", "-n", NAMESPACE, "--replicas=0")
        wait_for(lambda: not pods_of(node, name), "the old replicas gone", timeout=120)
        node.kubectl("patch", "mw", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps({"spec": {
            "format": {"tensorParallelSize": 1}, "serving": {"nodeCache": {"prewarm": {
                "nodeSelector": {"kubernetes.io/hostname": localnode.NODE_NAME}}}}}}))

        def rewired():
            annotations = node.get_json("deployment", name, "-n", NAMESPACE)["spec"]["template"]["metadata"].get(
                "annotations") or {}
            new = annotations.get("ferry.dev/artifact-digest")
            return new if new != digest else None
        new_digest = wait_for(rewired, "the Deployment wired to the new artifact", timeout=420)
        assert published(cache_key(new_digest)), "the Deployment was patched before the node held the new artifact"
        assert f"evicted {cache_key(digest)}" in agent_log(node, chart_operator["namespace"])
        # The node's labels follow: the new artifact's on, the evicted one's off.
        wait_for(lambda: label_for(new_digest) in node_labels(node) and label_for(digest) not in node_labels(node),
                 "the node's cache labels follow the eviction")
        node.kubectl("scale", f"deployment/{name}", "-n", NAMESPACE, "--replicas=1")
        wait_for(lambda: (mw_status(node, NAMESPACE, name).get("loaded") or {}).get("summary") == "1/1",
                 "the new replica loaded", timeout=240)
        status = wait_ready(node, NAMESPACE, name, timeout=120)
        assert status["cache"]["digest"] == new_digest and status["cache"]["summary"] == "1", status["cache"]
        log = agent_log(node, chart_operator["namespace"])
        assert sum(f"fill slot of {cache_key(new_digest)}" in line for line in log.splitlines()) == 1, log

        # The node lets the artifact go with no pod of it left there (an admin's `ferry cache evict` in the
        # agent's pod): status.cache counts it gone from the agent's labels, and an Event says why.
        node.kubectl("scale", f"deployment/{name}", "-n", NAMESPACE, "--replicas=0")
        wait_for(lambda: not pods_of(node, name), "the replica gone", timeout=120)
        in_agent(node, chart_operator["namespace"], "evict", "--digest", new_digest)
        cache = wait_for(lambda: (c := mw_status(node, NAMESPACE, name)["cache"])["warmNodes"] == 0 and c,
                         "status.cache counting the node gone", timeout=150)
        assert [(e["node"], e["reason"]) for e in cache["evictions"]] == [(localnode.NODE_NAME, "removed")], cache
        assert node_labels(node)[evicted_label_for(new_digest)].startswith("removed.")
        events = wait_for(lambda: [e["message"] for e in node.get_json(
            "events", "-n", NAMESPACE, "--field-selector",
            f"involvedObject.name={name},reason=NodeCacheEvicted")["items"]], "the NodeCacheEvicted event")
        assert f"the node cache on {localnode.NODE_NAME} no longer holds the artifact: removed by an admin" in \
            events[0], events
        # Two fills, two adoptions and two evictions later: the planted code never ran in any Job pod of hers,
        # and the other pod's canary is whole (read on the host and by the pod itself).
        assert_no_hostile_env(node, name, fetched=False)  # the prepare Jobs may have gone by now
        assert not (planted / "RAN").exists()
        assert canary.read_text() == "canary\n"
        assert node.kubectl("exec", victim, "-n", RESTRICTED_NS, "--", "cat", "/scratch/canary").stdout == "canary\n"
    finally:  # its pods mount a node cache entry: they must go while the agent runs
        node.kubectl("delete", "mw", name, "-n", NAMESPACE, "--wait=false", check=False)
        node.kubectl("delete", "deployment", name, "-n", NAMESPACE, "--wait=true", "--timeout=90s", check=False,
                     timeout=120)
        if victim:
            delete_pods(node, RESTRICTED_NS, victim)
        node.kubectl("delete", "pvc", f"{name}-own", "-n", NAMESPACE, "--wait=false", check=False)


def test_a_prewarm_of_another_teams_tainted_node_places_no_pod_there_and_stalls(node, chart_operator, node_s3,
                                                                                checkpoint):
    """A tenant's prewarm selects a node dedicated to another team (its taint team-b:NoSchedule, which her
    Deployment's pod template does not tolerate). The operator makes no fill Job and so places no pod there,
    leaves her Deployment unpatched, and stalls naming the node and the taint. The node is a kwok node of
    this test's own (kwok plays its kubelet), labelled so that only it matches the selector."""
    name = unique("teamb")
    dedicated = f"ferry-{name}"
    taint = {"key": "team", "value": "b", "effect": "NoSchedule"}
    node.apply({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": dedicated, "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        "labels": {"kubernetes.io/hostname": dedicated, "type": "kwok", "ferry.dev/test-team": name}},
        "spec": {"taints": [taint]}})
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    standin_deployment(node, name)
    mw = modelweights(name, f"s3://{name}/tiny-llama", {"type": "safetensors"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}], "nodeCache": {
        "enabled": True, "prewarm": {"nodeSelector": {"ferry.dev/test-team": name}}}}
    node.apply(mw)
    try:
        stalled = wait_stalled(node, NAMESPACE, name, timeout=420)  # after the prepare step
        assert stalled["reason"] == "PrewarmNodesRefused", stalled
        assert (f"node {dedicated}: taint team=b:NoSchedule is not tolerated by deployment {name}'s pod "
                f"template") in stalled["message"], stalled
        assert condition(mw_status(node, NAMESPACE, name), "Prepared")["status"] == "True"
        # Held a while longer: still no fill Job, no pod of the tenant's namespace on the node, no patch.
        for _ in range(5):
            assert fill_jobs(node, name) == []
            on_node = node.get_json("pods", "-n", NAMESPACE, "--field-selector", f"spec.nodeName={dedicated}")
            assert on_node["items"] == [], [p["metadata"]["name"] for p in on_node["items"]]
            annotations = node.get_json("deployment", name, "-n", NAMESPACE)["spec"]["template"]["metadata"].get(
                "annotations") or {}
            assert "ferry.dev/artifact-digest" not in annotations, annotations
            time.sleep(2)
    finally:
        node.kubectl("delete", "mw", name, "-n", NAMESPACE, "--wait=false", check=False)
        node.kubectl("delete", "deployment", name, "-n", NAMESPACE, "--wait=true", "--timeout=90s", check=False,
                     timeout=120)
        node.kubectl("delete", "node", dedicated, "--wait=false", check=False)


def node_labels(kube) -> dict[str, str]:
    return kube.get_json("node", localnode.NODE_NAME)["metadata"].get("labels") or {}


def test_an_s3_artifact_fills_the_node_cache_from_its_prefix_once(node, chart_operator, node_s3, checkpoint):
    """runai_streamer published to storage.s3 with serving.nodeCache: the fill Job reads the prefix with the
    ModelWeights' own S3 credentials, the pods mount the node's entry (no S3 endpoint or credentials in
    them), and two replicas cost the S3 server one GET of each weights object in all (its request log)."""
    name = unique("s3cache")
    clear_cache()
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    standin_deployment(node, name)
    mw = modelweights(name, f"s3://{name}/tiny-llama", {"type": "runai_streamer", "vllmVersion": "0.32"},
                      secret=f"{name}-s3")
    mw["spec"]["storage"]["s3"] = {"uri": f"s3://{name}/artifacts", "endpoint": node_s3.endpoint,
                                   "credentialsSecretRef": {"name": f"{name}-s3"}}
    mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}], "nodeCache": {"enabled": True}}
    node.apply(mw)
    try:
        artifact = wait_ready(node, NAMESPACE, name, timeout=420)["artifact"]
        digest, uri = artifact["manifestDigest"], artifact["uri"]
        assert uri.startswith(f"s3://{name}/artifacts/"), uri
        job = fill_jobs(node, name)[0]
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--source") + 1] == uri.rstrip("/")
        template = node.get_json("deployment", name, "-n", NAMESPACE)["spec"]["template"]["spec"]
        (vllm,) = [c for c in template["containers"] if c["name"] == "vllm"]
        line = vllm.get("command", []) + vllm["args"]
        assert "/ferry/weights" in line and not any("s3://" in a for a in line), line
        assert line[line.index("--load-format") + 1] == "runai_streamer"
        assert not [e for e in vllm.get("env") or [] if e["name"].startswith("AWS_")]
        node.kubectl("scale", f"deployment/{name}", "-n", NAMESPACE, "--replicas=2")
        wait_for(lambda: (mw_status(node, NAMESPACE, name).get("loaded") or {}).get("summary") == "2/2",
                 "both replicas loaded from the node's entry", timeout=300)
        log = agent_log(node, chart_operator["namespace"])
        assert sum(f"fill slot of {cache_key(digest)}" in line for line in log.splitlines()) == 1, log
        prefix = uri.removeprefix(f"s3://{name}/").rstrip("/")
        gets = [line for line in (node_s3.root / "server.log").read_text().splitlines()
                if "GET OBJECT" in line and f"Bucket: {name} Object: {prefix}/" in line
                and line.endswith(".safetensors")]
        weights = {line.rsplit("/", 1)[1] for line in gets}
        assert weights and len(gets) == len(weights), gets  # each weights object read once: by the one fill

        # A byte of the entry flipped under the running pods, found by an admin's `ferry cache check` in the
        # agent's pod (the scrub does the same on its schedule): the ModelWeights and each pod are told,
        # and the entry goes as its pods do.
        victim = flip_byte(sorted((cache_dir() / "entries" / cache_key(digest)).rglob("*.safetensors"))[0], 0)
        checked = in_agent(node, chart_operator["namespace"], "check", "--digest", digest, check=False)
        assert checked.returncode != 0 and victim.name in checked.stdout + checked.stderr, checked
        running = sorted(p["metadata"]["name"] for p in pods_of(node, name))
        evictions = wait_for(lambda: (mw_status(node, NAMESPACE, name).get("cache") or {}).get("evictions"),
                             "the corrupt entry in status.cache.evictions", timeout=150)
        assert [(e["node"], e["reason"], sorted(e["pods"])) for e in evictions] == [
            (localnode.NODE_NAME, "corrupt", running)], evictions
        for pod in running:
            said = wait_for(lambda: [e["message"] for e in node.get_json(
                "events", "-n", NAMESPACE, "--field-selector",
                f"involvedObject.name={pod},reason=NodeCacheCorrupt")["items"]], f"the event on {pod}")
            assert "delete the pod to mount a refilled entry" in said[0], said
        node.kubectl("scale", f"deployment/{name}", "-n", NAMESPACE, "--replicas=0")
        wait_for(lambda: not published(cache_key(digest)), "the corrupt entry removed as its pods went",
                 timeout=120)
    finally:  # its pods mount a node cache entry: they must go while the agent runs
        node.kubectl("delete", "mw", name, "-n", NAMESPACE, "--wait=false", check=False)
        node.kubectl("delete", "deployment", name, "-n", NAMESPACE, "--wait=true", "--timeout=90s", check=False,
                     timeout=120)


def fill_jobs(kube, name: str) -> list[dict]:
    return [j for j in kube.get_json("jobs", "-n", NAMESPACE, "-l", f"ferry.dev/modelweights={name}")["items"]
            if j["metadata"]["labels"].get("ferry.dev/step") == "cache-fill"]
