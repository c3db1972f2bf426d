"""Superseded artifacts are removed per deletionPolicy once the new one is
serving: Delete removes every earlier one, Retain keeps the newest
FERRY_RETAIN_PREVIOUS_ARTIFACTS. Local executor (the directories) and the
kubernetes executor on kwok's node (the Jobs, and the cleanup Job that removes
the data from the claim; tests/node/ runs that one for real)."""
from __future__ import annotations

import json

import pytest
import localcluster
from cluster_support import running_operator, wait_for
from ferry_operator.api.validation import parse
from ferry_operator.steps import spec_digest
from test_operator_local import modelweights, tiny_checkpoint, wait_ready_generation

pytestmark = pytest.mark.cluster
# Each pattern list shapes a different artifact (a new spec digest).
PATTERNS = (["*.safetensors"], ["model*.safetensors"], ["model.safetensors"])


def revisions(kube, namespace, name, uri, policy, count):
    """Apply `count` shaping spec changes, each waited to Ready; the digests, oldest first."""
    digests = []
    for generation, patterns in enumerate(PATTERNS[:count], start=1):
        mw = modelweights(name, namespace, uri, deletionPolicy=policy)
        mw["spec"]["source"]["allowPatterns"] = patterns
        kube.apply(mw)
        status = wait_ready_generation(kube, namespace, name, generation)
        digests.append(status["artifact"]["specDigest"])
    return digests


@pytest.mark.parametrize("policy,kept", [("Delete", []), ("Retain", [1])])
def test_local_executor_removes_superseded_artifacts_per_policy(crd, namespace, tmp_path, policy, kept):
    root = tmp_path / "artifacts"
    src = tiny_checkpoint(tmp_path / "src")
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="local",
                          FERRY_LOCAL_ROOT=str(root), FERRY_RETAIN_PREVIOUS_ARTIFACTS="1"):
        digests = revisions(crd, namespace, "gc", f"file://{src}", policy, 3)
        base = root / namespace / "gc"
        expect = {digests[2], *(digests[i] for i in kept)}
        wait_for(lambda: {d.name for d in base.iterdir() if not d.name.startswith(".")} == expect,
                 f"only {sorted(expect)} left", timeout=30)
        status = crd.get_json("mw", "gc", "-n", namespace)["status"]
        assert [a["specDigest"] for a in status.get("previousArtifacts", [])] == [digests[i] for i in kept]
        assert not list((base / ".steps").glob(f"*-{digests[0]}*"))
        events = crd.get_json("events", "-n", namespace, "--field-selector", "involvedObject.name=gc")["items"]
        assert sum(e.get("count") or 1 for e in events if e["reason"] == "ArtifactRemoved") == 2 - len(kept)


KWOK = {"FERRY_WORKER_NODE_SELECTOR": json.dumps({"type": "kwok"}),
        "FERRY_WORKER_TOLERATIONS": json.dumps([{"key": "nvidia.com/gpu", "operator": "Exists",
                                                 "effect": "NoSchedule"}])}


@pytest.mark.parametrize("policy", ["Delete", "Retain"])
def test_kubernetes_executor_removes_superseded_jobs_and_data(crd, namespace, tmp_path, policy):
    """kwok completes the Jobs without running them; each fetch's result is
    written into its pod's termination message here, as the worker would."""
    with running_operator(crd, namespace, tmp_path / "operator.log", FERRY_EXECUTOR="kubernetes",
                          FERRY_WORKER_IMAGE="ghcr.io/ferry-dev/ferry:test", FERRY_RETAIN_PREVIOUS_ARTIFACTS="1",
                          **KWOK):
        crd.apply({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"pv-{namespace}"},
                   "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteOnce"],
                            "storageClassName": f"manual-{namespace}", "hostPath": {"path": f"/tmp/{namespace}"}}})
        wait_for(lambda: crd.get_json("pv", f"pv-{namespace}").get("status", {}).get("phase") == "Available",
                 "the volume Available")
        digests = []
        for generation, patterns in enumerate(PATTERNS, start=1):
            mw = {"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights",
                  "metadata": {"name": "gc", "namespace": namespace},
                  "spec": {"source": {"uri": "hf://org/tiny", "allowPatterns": patterns},
                           "storage": {"pvc": {"size": "1Gi", "storageClassName": f"manual-{namespace}"}},
                           "format": {"type": "safetensors"}, "deletionPolicy": policy}}
            crd.apply(mw)
            job = wait_for(lambda: next((j for j in crd.get_json("jobs", "-n", namespace)["items"]
                                         if j["metadata"]["labels"]["ferry.dev/step"] == "fetch"
                                         and j["status"].get("succeeded")
                                         and j["metadata"]["annotations"]["ferry.dev/step-id"].endswith(
                                             _digest(mw))), None),
                           # A pod rejected for its then-unbound claim is tried again within the local
                           # scheduler's promise (5 minutes with a default scheduler).
                           f"fetch Job of generation {generation} complete",
                           timeout=60 + localcluster.UNSCHEDULABLE_RETRY_S)
            (pod,) = crd.get_json("pods", "-n", namespace, "-l", f"job-name={job['metadata']['name']}")["items"]
            statuses = pod["status"]["containerStatuses"]
            statuses[0]["state"]["terminated"]["message"] = json.dumps(
                {"manifestDigest": "sha256:" + f"{generation}" * 64, "totalBytes": 1 << 20})
            crd.kubectl("patch", "pod", pod["metadata"]["name"], "-n", namespace, "--subresource=status",
                        "--type=merge", "-p", json.dumps({"status": {"containerStatuses": statuses}}))
            digests.append(wait_ready_generation(crd, namespace, "gc", generation)["artifact"]["specDigest"])

        removed = digests[:2] if policy == "Delete" else digests[:1]
        def settled():
            items = crd.get_json("jobs", "-n", namespace)["items"]
            fetches = {j["metadata"]["annotations"]["ferry.dev/step-id"].rsplit("-", 1)[1] for j in items
                       if j["metadata"]["labels"]["ferry.dev/step"] == "fetch"}
            cleanups = {j["metadata"]["annotations"]["ferry.dev/removes"]: j for j in items
                        if j["metadata"]["labels"]["ferry.dev/step"] == "gc"}
            return (fetches, cleanups) if fetches == set(digests) - set(removed) and set(cleanups) == set(removed) \
                else None
        fetches, cleanups = wait_for(settled, "old Jobs gone and cleanup Jobs created", timeout=60)
        uid = crd.get_json("mw", "gc", "-n", namespace)["metadata"]["uid"]
        for digest, job in cleanups.items():
            (c,) = job["spec"]["template"]["spec"]["containers"]
            # Its own directory only: the uid in the path keeps another object's on the claim out of reach.
            assert c["command"] == ["rm", "-rf", "--one-file-system", f"/weights/gc/{uid}/{digest}"]
            assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "gc-weights"


def _digest(mw: dict) -> str:
    """The spec digest the operator will give this spec's artifact."""
    return spec_digest(parse({**mw, "metadata": {**mw["metadata"], "generation": 1}}).spec)
