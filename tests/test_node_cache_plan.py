"""serving.nodeCache without a cluster: the wiring (the CSI volume in place of
the claim), the fill Jobs the planner asks for (a node where a wired pod
waits, the prewarm nodes), a node warm only once a round found the entry
published, a rollout held until the prewarm nodes are warm, an entry gone
from a warm node filled again, a failed fill retried with its reason,
status.cache, and the admission rules. On the real node:
tests/node/test_node_cache_on_node.py."""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest

from ferry_operator.api.types import Artifact
from ferry_operator.api.validation import InvalidSpec, parse
from ferry_operator.executors.cache_fill import fill_facts, fill_job_manifest
from ferry_operator.executors.jobs import WorkerSettings
from ferry_operator.node_cache import FillFacts, FillNode, RemoveFill
from ferry_operator.placement import NodeFacts, placement_of
from ferry_operator.planner import ArtifactFacts, Observed, PatchWorkload, StepPhase, StepState, plan
from ferry_operator.serving.wiring import CACHE_AGENT_LABEL, WorkloadFacts, cache_evicted_label, cache_label
from ferry_operator.serving.loader import LoaderSettings
from ferry_operator.steps import prepare_steps
from ferry_operator.serving.weights_loaded import PodFacts
from serving_cases import apply, merged_weights_volume
from spec_cases import manifest, with_

DIGEST = "sha256:" + "1" * 64
FACTS = ArtifactFacts(uri="pvc://llama-weights/llama/abc", total_bytes=3 << 30, manifest_digest=DIGEST)
LOADER = LoaderSettings(image="ferry.local/ferry:dev")
NAME = "llama-70b-vllm"
FIXED = datetime(2026, 12, 2, 8, 0, tzinfo=timezone.utc)


def ago(seconds: float = 30) -> datetime:
    """Plans are made at the real time (the planner's clock): pods and fills are dated relative to it, when
    the test runs (not when it was collected)."""
    return datetime.now(timezone.utc) - timedelta(seconds=seconds)


def cached(prewarm: dict | None = None, **cache):
    obj = with_("serving.nodeCache", {"enabled": True, **({"prewarm": prewarm} if prewarm else {}), **cache})
    return parse({**obj, "metadata": {**obj["metadata"], "generation": 2, "namespace": "ml", "uid": "u-1"}})


def deployment(**kw) -> WorkloadFacts:
    base = WorkloadFacts(name=NAME, containers={"vllm": ["--model", "meta-llama/Meta-Llama-3-70B-Instruct"]},
                           template_annotations={}, rolled_out=True, service_account="serving", replicas=1)
    return replace(base, **kw)


def observed(m, dep: WorkloadFacts, pods=(), fills=(), prewarm=(), nodes=None, facts=None) -> Observed:
    """`nodes`: the agent's labels by node; `facts`: the node index (default: every node named here, with
    no labels or taints)."""
    named = set(prewarm) | {p.node for p in pods if p.node} | {f.node for f in fills}
    return Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}, artifact=FACTS,
                    workloads={NAME: dep}, pods=list(pods), fills=list(fills), prewarm_nodes=list(prewarm),
                    cache_nodes=nodes or {}, nodes=facts if facts is not None else {n: NodeFacts(n) for n in named},
                    node_agent=True)


def waiting_pod(node: str, created: datetime | None = None, digest: str = DIGEST) -> PodFacts:
    return PodFacts(name=f"p-{node}", owner="llama", digest=digest, gate=None, workload=NAME, node=node,
                    awaiting_volumes=True, created=created or ago())


def wired(m, current: WorkloadFacts | None = None) -> WorkloadFacts:
    """The Deployment after Ferry's patch (what the planner reads back)."""
    current = current or deployment()
    (patch,) = [a for a in plan(m, observed(m, current), loader=LOADER).actions if isinstance(a, PatchWorkload)]
    pod = patch.patch["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    inits = {i["name"]: {"image": i["image"], "args": i["args"]} for i in pod["initContainers"]}
    preferred = pod.get("affinity", {}).get("nodeAffinity", {}).get("preferredDuringSchedulingIgnoredDuringExecution",
                                                                     current.preferred_nodes)
    return replace(current, containers={"vllm": c["args"]}, template_annotations=patch.patch["spec"]["template"][
        "metadata"]["annotations"], init_containers=inits, readiness_gates=[g["conditionType"] for g in pod[
            "readinessGates"]], probed=frozenset({"vllm"}), weights_volume=merged_weights_volume(current, pod),
        preferred_nodes=preferred)


def kinds(p, kind):
    return [a for a in p.actions if isinstance(a, kind)]


def test_the_pods_get_the_node_cache_volume_in_place_of_the_claim():
    m = cached()
    (patch,) = kinds(plan(m, observed(m, deployment()), loader=LOADER), PatchWorkload)
    pod = patch.patch["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "ferry-weights")
    assert volume == {"name": "ferry-weights", "$retainKeys": ["name", "csi"],
                      "csi": {"driver": "cache.ferry.dev", "readOnly": True, "volumeAttributes": {"digest": DIGEST}}}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "ferry-weights")
    assert mount["readOnly"] and mount["mountPath"] == "/ferry/weights" and mount["subPath"] is None
    # The loader still verifies the pod's files, now on the node's entry.
    (init,) = pod["initContainers"]
    assert init["args"][:2] == ["load", "--artifact"] and any(m["name"] == "ferry-weights" for m in init["volumeMounts"])


def test_turning_the_node_cache_on_or_off_rolls_the_deployment_once():
    plain = parse({**manifest(), "metadata": {"name": "llama", "generation": 2, "namespace": "ml", "uid": "u-1"}})
    on_claim = wired(plain)
    assert on_claim.weights_volume == "persistentVolumeClaim"
    m = cached()
    (patch,) = kinds(plan(m, observed(m, on_claim), loader=LOADER), PatchWorkload)  # same digest: still rolls
    on_cache = wired(m)
    assert on_cache.weights_volume == "csi"
    assert kinds(plan(m, observed(m, on_cache), loader=LOADER), PatchWorkload) == []
    assert kinds(plan(plain, observed(plain, on_cache), loader=LOADER), PatchWorkload)  # and back to the claim


RUNAI_S3 = manifest(format={"type": "runai_streamer", "tensorParallelSize": 2}, storage={
    "pvc": {"size": "200Gi"}, "s3": {"uri": "s3://ferry-artifacts/llama", "endpoint": "http://minio.storage:9000",
                                     "credentialsSecretRef": {"name": "s3-creds"}}})
S3_FACTS = ArtifactFacts(uri="s3://ferry-artifacts/llama/abc", total_bytes=3 << 30, manifest_digest=DIGEST)


@pytest.mark.parametrize("load_format", ["runai_streamer", "runai_streamer_sharded"])
def test_an_s3_artifact_is_served_from_the_node_cache_with_no_s3_in_the_pod_and_back(load_format):
    """runai_streamer (or its sharded form) published to storage.s3: the pods mount the node's entry and
    stream it from local disk (vLLM's Run:ai loaders read a directory too), with no S3 endpoint or
    credentials; turned off, the store's URI and credentials come back and the volume goes."""
    def spec(cache: bool):
        obj = with_("serving.nodeCache", {"enabled": cache}, with_("format.type", load_format, RUNAI_S3))
        return parse({**obj, "metadata": {**obj["metadata"], "generation": 2, "namespace": "ml", "uid": "u-1"}})

    def wire(m, current: WorkloadFacts):
        seen = Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)},
                        artifact=S3_FACTS, workloads={NAME: current}, fills=[], node_agent=True)
        (patch,) = kinds(plan(m, seen, loader=LOADER), PatchWorkload)
        return patch.patch["spec"]["template"]["spec"], apply(current, patch.patch)

    _, streamed = wire(spec(False), deployment())
    pod, on_cache = wire(spec(True), streamed)
    (c,) = pod["containers"]
    assert "/ferry/weights" in c["args"] and not any("s3://" in a for a in c["args"])
    assert c["args"][c["args"].index("--load-format") + 1] == load_format
    assert next(v for v in pod["volumes"] if v["name"] == "ferry-weights")["csi"]["volumeAttributes"] == {
        "digest": DIGEST}
    (init,) = pod["initContainers"]
    assert init["args"][init["args"].index("--artifact") + 1] == "/ferry/weights"
    # The S3 env an earlier wiring gave both containers goes (env merges by name).
    for container in (c, init):
        aws = [e for e in container["env"] if e["name"].startswith("AWS_")]
        assert aws and all(e == {"name": e["name"], "$patch": "delete"} for e in aws), container["env"]
    assert on_cache.weights_volume == "csi"

    pod, off = wire(spec(False), on_cache)
    (c,) = pod["containers"]
    assert any(a.startswith("s3://ferry-artifacts/llama/abc") for a in c["args"])
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"} in c["env"]
    assert {"name": "ferry-weights", "$patch": "delete"} in pod["volumes"]
    # Both containers' mounts of it go with it (an init container's mount of a deleted volume is a 422).
    (init,) = pod["initContainers"]
    assert c["volumeMounts"] == [{"mountPath": "/ferry/weights", "$patch": "delete"}]
    assert {"mountPath": "/ferry/weights", "$patch": "delete"} in init["volumeMounts"]
    assert off.weights_volume == ""


def test_the_fill_job_of_an_s3_artifact_reads_its_prefix_with_the_objects_credentials():
    obj = with_("serving.nodeCache", {"enabled": True}, RUNAI_S3)
    m = parse({**obj, "metadata": {**obj["metadata"], "generation": 2, "namespace": "ml", "uid": "u-1"}})
    artifact = Artifact(uri=S3_FACTS.uri, format="runai_streamer", total_bytes=S3_FACTS.total_bytes,
                        manifest_digest=DIGEST)
    job = fill_job_manifest(m, "u-1", "gpu-a", artifact, 0, WorkerSettings(image="ferry.local/ferry:dev"))
    pod = job["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]  # no claim
    (c,) = pod["containers"]
    assert c["args"] == ["cache", "fill-slot", "--slot", "/ferry/cache-slot", "--source",
                         "s3://ferry-artifacts/llama/abc", "--digest", DIGEST]
    assert {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {
        "name": "s3-creds", "key": "AWS_ACCESS_KEY_ID", "optional": False}}} in c["env"]
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"} in c["env"]
    assert pod["automountServiceAccountToken"] is False


USERS_TERM = {"weight": 100, "preference": {"matchExpressions": [
    {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}]}}


def ferry_terms(d: WorkloadFacts) -> list[dict]:
    return [t for t in d.preferred_nodes if t["preference"]["matchExpressions"][0]["key"].startswith("cache.ferry.dev/")]


def test_wired_pods_prefer_the_nodes_that_hold_their_artifact_and_keep_the_users_preferences():
    m = cached()
    on_cache = wired(m, deployment(preferred_nodes=[USERS_TERM]))
    # The node agent's label for this digest (a hash of it), preferred, never required.
    assert ferry_terms(on_cache) == [{"weight": 50, "preference": {"matchExpressions": [
        {"key": cache_label(DIGEST), "operator": "Exists"}]}}]
    assert on_cache.preferred_nodes[0] == USERS_TERM
    assert kinds(plan(m, observed(m, on_cache), loader=LOADER), PatchWorkload) == []  # wired: no second roll

    # A new artifact: the term follows the digest (the old one's is dropped, the user's stays).
    new = replace(FACTS, manifest_digest="sha256:" + "2" * 64)
    (patch,) = kinds(plan(m, replace(observed(m, on_cache), artifact=new), loader=LOADER), PatchWorkload)
    terms = patch.patch["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms == [USERS_TERM, {"weight": 50, "preference": {"matchExpressions": [
        {"key": cache_label("sha256:" + "2" * 64), "operator": "Exists"}]}}]

    # The cache turned off: Ferry's term goes with it, the user's stays.
    plain = parse({**manifest(), "metadata": {"name": "llama", "generation": 2, "namespace": "ml", "uid": "u-1"}})
    on_claim = wired(plain, on_cache)
    assert on_claim.weights_volume == "persistentVolumeClaim" and on_claim.preferred_nodes == [USERS_TERM]


def warm(node: str, round_: int = 1, at: datetime | None = None) -> FillFacts:
    return FillFacts(node, DIGEST, "Succeeded", finished_at=at or ago(), round=round_, confirmed=True)


def test_a_pod_waiting_on_a_node_gets_a_fill_and_the_node_is_warm_once_confirmed():
    m = cached()
    dep = wired(m)
    p = plan(m, observed(m, dep, pods=[waiting_pod("gpu-a")], fills=[]), loader=LOADER)
    (fill,) = kinds(p, FillNode)
    assert (fill.node, fill.round) == ("gpu-a", 0)
    assert fill.artifact.manifest_digest == DIGEST and fill.artifact.uri == FACTS.uri
    assert p.status.cache.summary == "0 (+1)" and p.status.cache.filling_nodes == 1
    running = FillFacts("gpu-a", DIGEST, "Running")
    p = plan(m, observed(m, dep, pods=[waiting_pod("gpu-a")], fills=[running]), loader=LOADER)
    assert kinds(p, FillNode) == [] and kinds(p, RemoveFill) == []
    # Round 0 filled: the Job is complete a moment before the agent publishes the entry, so not warm yet;
    # round 1 starts at once (it finds the entry, or waits for it).
    filled = FillFacts("gpu-a", DIGEST, "Succeeded", finished_at=ago(0))
    p = plan(m, observed(m, dep, pods=[waiting_pod("gpu-a")], fills=[filled]), loader=LOADER)
    assert [(a.node, a.round) for a in kinds(p, FillNode)] == [("gpu-a", 1)] and p.status.cache.warm_nodes == 0
    p = plan(m, observed(m, dep, pods=[waiting_pod("gpu-a")], fills=[filled, warm("gpu-a")]), loader=LOADER)
    assert p.actions == [RemoveFill("gpu-a", DIGEST, 0)]  # only the latest round is kept
    assert p.status.cache.warm_nodes == 1 and p.status.cache.nodes == ["gpu-a"]
    assert p.status.cache.summary == "1" and p.status.cache.digest == DIGEST
    # A pod that is not waiting for volumes (running, or unscheduled) asks for nothing.
    elsewhere = replace(waiting_pod("gpu-b"), awaiting_volumes=False)
    assert kinds(plan(m, observed(m, dep, pods=[elsewhere], fills=[warm("gpu-a")]), loader=LOADER), FillNode) == []


def test_an_entry_gone_from_a_warm_node_is_filled_again():
    m = cached()
    done = warm("gpu-a", at=ago(210))
    gone = waiting_pod("gpu-a", created=ago(150))  # came after the fill, and still waits
    p = plan(m, observed(m, wired(m), pods=[gone], fills=[done]), loader=LOADER)
    assert [(a.node, a.round) for a in kinds(p, FillNode)] == [("gpu-a", 2)]
    assert "filling again" in {c.type: c.message for c in p.status.conditions}["Reconciling"]
    # A pod that came moments ago may still be mounting (verifying the entry): left alone.
    soon = waiting_pod("gpu-a", created=ago())
    assert kinds(plan(m, observed(m, wired(m), pods=[soon], fills=[done]), loader=LOADER), FillNode) == []
    # A round that ended moments ago: its entry gets its chance first.
    fresh = warm("gpu-a", at=ago())
    assert kinds(plan(m, observed(m, wired(m), pods=[gone], fills=[fresh]), loader=LOADER), FillNode) == []


def test_nodes_whose_agent_labels_them_are_counted_by_their_labels_and_others_by_their_fills():
    m = cached()
    holds = {CACHE_AGENT_LABEL: "true", cache_label(DIGEST): "true"}
    nodes = {"gpu-a": holds, "gpu-b": {CACHE_AGENT_LABEL: "true"}, "gpu-c": holds}
    # gpu-a: labelled and filled. gpu-b: filled, but its agent's labels say the entry is gone (evicted since,
    # with no pod left there to wait for it). gpu-c: labelled, never filled by this object (another
    # ModelWeights of the same artifact did). gpu-d: its agent does not label (its policy not enforced):
    # the fill round says.
    fills = [warm("gpu-a"), warm("gpu-b"), warm("gpu-d")]
    p = plan(m, observed(m, wired(m), fills=fills, nodes=nodes), loader=LOADER)
    assert p.status.cache.nodes == ["gpu-a", "gpu-c", "gpu-d"] and p.status.cache.summary == "3"
    assert kinds(p, FillNode) == []


def test_a_prewarm_node_whose_agent_says_the_entry_went_is_filled_again_and_a_warm_one_is_not_filled():
    m = cached(prewarm={"nodeSelector": {"pool": "h100"}})
    holds = {CACHE_AGENT_LABEL: "true", cache_label(DIGEST): "true"}
    gone = {CACHE_AGENT_LABEL: "true", cache_evicted_label(DIGEST): "lru.1796198400"}
    # gpu-a: evicted after its fill; gpu-b: warm from another object's fill, never filled by this one.
    fills = [warm("gpu-a", at=ago(60))]
    p = plan(m, observed(m, deployment(), fills=fills, prewarm=["gpu-a", "gpu-b"],
                         nodes={"gpu-a": gone, "gpu-b": holds}), loader=LOADER)
    assert [(a.node, a.round) for a in kinds(p, FillNode)] == [("gpu-a", 2)]
    assert "no longer holds the artifact (its agent's labels): filling again" in \
        {c.type: c.message for c in p.status.conditions}["Reconciling"]
    assert kinds(p, PatchWorkload) == []  # held until gpu-a holds it again
    # A fill that ended moments ago: its label may not have arrived yet.
    fresh = plan(m, observed(m, deployment(), fills=[warm("gpu-a", at=ago(5))], prewarm=["gpu-a", "gpu-b"],
                             nodes={"gpu-a": gone, "gpu-b": holds}), loader=LOADER)
    assert kinds(fresh, FillNode) == []
    # Nobody wants gpu-a any more: no refill there.
    unwanted = plan(m, observed(m, deployment(), fills=fills, prewarm=["gpu-b"],
                                nodes={"gpu-a": gone, "gpu-b": holds}), loader=LOADER)
    assert kinds(unwanted, FillNode) == [] and kinds(unwanted, PatchWorkload)


def test_a_node_that_lets_the_artifact_go_is_an_eviction_with_its_reason_and_an_event():
    from ferry_operator.events import transitions

    m = cached()
    holds = {CACHE_AGENT_LABEL: "true", cache_label(DIGEST): "true"}
    before = plan(m, observed(m, wired(m), nodes={"gpu-a": holds, "gpu-b": holds, "gpu-c": holds}),
                  loader=LOADER).status
    assert before.cache.nodes == ["gpu-a", "gpu-b", "gpu-c"] and before.cache.evictions == []
    m = m.model_copy(update={"status": before})
    gone = {"gpu-a": {CACHE_AGENT_LABEL: "true", cache_evicted_label(DIGEST): "lru.1796198400"},
            "gpu-b": {CACHE_AGENT_LABEL: "true", cache_evicted_label(DIGEST): "corrupt.1796198460"},
            "gpu-c": holds}
    after = plan(m, observed(m, wired(m), nodes=gone), loader=LOADER).status
    assert after.cache.nodes == ["gpu-c"]
    assert [(e.node, e.reason, e.at.isoformat()) for e in after.cache.evictions] == [
        ("gpu-a", "lru", "2026-12-02T08:00:00+00:00"), ("gpu-b", "corrupt", "2026-12-02T08:01:00+00:00")]
    events = [(e.type, e.reason, e.message) for e in transitions(before, after, []) if e.reason == "NodeCacheEvicted"]
    assert [e[:2] for e in events] == [("Normal", "NodeCacheEvicted"), ("Warning", "NodeCacheEvicted")]
    assert "on gpu-a no longer holds the artifact: evicted as least recently used" in events[0][2]
    assert "gpu-b" in events[1][2] and "removed as corrupt" in events[1][2] and "1 node still holds it" in events[1][2]
    # Said once: the next reconcile keeps the record and posts nothing.
    m = m.model_copy(update={"status": after})
    again = plan(m, observed(m, wired(m), nodes=gone), loader=LOADER).status
    assert again.cache.evictions == after.cache.evictions
    assert [e for e in transitions(after, again, []) if e.reason == "NodeCacheEvicted"] == []
    # Found corrupt under this object's pods there: they are named, and each gets an Event of its own.
    running = [replace(waiting_pod("gpu-c"), name="p-1", awaiting_volumes=False),
               replace(waiting_pod("gpu-c"), name="p-2", awaiting_volumes=False),
               replace(waiting_pod("gpu-a"), name="p-3", awaiting_volumes=False)]
    corrupt = {**gone, "gpu-c": {CACHE_AGENT_LABEL: "true", cache_evicted_label(DIGEST): "corrupt.1796198520"}}
    m = m.model_copy(update={"status": again})
    last = plan(m, observed(m, wired(m), pods=running, nodes=corrupt), loader=LOADER).status
    assert (last.cache.evictions[-1].node, last.cache.evictions[-1].pods) == ("gpu-c", ["p-1", "p-2"])
    posted = [(e.reason, e.pod, e.message) for e in transitions(again, last, []) if e.reason.startswith("NodeCache")]
    assert [p[:2] for p in posted] == [("NodeCacheEvicted", None), ("NodeCacheCorrupt", "p-1"),
                                       ("NodeCacheCorrupt", "p-2")]
    assert "kubectl delete pod p-1 p-2" in posted[0][2] and "0 nodes still hold it" in posted[0][2]
    assert "delete the pod to mount a refilled entry" in posted[1][2]
    # A node whose agent remembers no reason, and a node that went away entirely (not an eviction).
    m = m.model_copy(update={"status": before})
    p = plan(m, observed(m, wired(m), nodes={"gpu-a": {CACHE_AGENT_LABEL: "true"}, "gpu-c": holds}), loader=LOADER)
    assert [(e.node, e.reason) for e in p.status.cache.evictions] == [("gpu-a", "unknown")]


def test_a_failed_fill_is_reported_with_its_reason_and_retried():
    m = cached()
    failed = FillFacts("gpu-a", DIGEST, "Failed", finished_at=datetime.now(timezone.utc),
                       message="CacheError: /source/llama/abc holds no ferry-manifest.json")
    p = plan(m, observed(m, wired(m), pods=[waiting_pod("gpu-a")], fills=[failed]), loader=LOADER)
    assert kinds(p, FillNode) == []  # not at once: after FILL_RETRY
    message = {c.type: c.message for c in p.status.conditions}["Reconciling"]
    assert "fill on gpu-a failed: CacheError: /source/llama/abc holds no ferry-manifest.json" in message
    old = replace(failed, finished_at=datetime.now(timezone.utc) - timedelta(minutes=2))
    p = plan(m, observed(m, wired(m), pods=[waiting_pod("gpu-a")], fills=[old]), loader=LOADER)
    assert [(a.node, a.round) for a in kinds(p, FillNode)] == [("gpu-a", 1)]


def test_prewarm_fills_the_selected_nodes_before_the_deployment_is_patched():
    m = cached(prewarm={"nodeSelector": {"pool": "h100"}})
    p = plan(m, observed(m, deployment(), prewarm=["gpu-a", "gpu-b"]), loader=LOADER)
    assert [a.node for a in kinds(p, FillNode)] == ["gpu-a", "gpu-b"] and kinds(p, PatchWorkload) == []
    assert "prewarming the node cache before the rollout: 0/2" in {c.type: c.message for c in p.status.conditions}[
        "Reconciling"]
    half = [warm("gpu-a"), FillFacts("gpu-b", DIGEST, "Running", job="llama-cache-b-0")]
    p = plan(m, observed(m, deployment(), fills=half, prewarm=["gpu-a", "gpu-b"]), loader=LOADER)
    assert kinds(p, PatchWorkload) == []
    message = {c.type: c.message for c in p.status.conditions}["Reconciling"]
    assert "1/2 nodes hold the artifact (waiting for gpu-b; kubectl describe pods -l job-name=llama-cache-b-0" in message
    both = [warm(n) for n in ("gpu-a", "gpu-b")]
    p = plan(m, observed(m, deployment(), fills=both, prewarm=["gpu-a", "gpu-b"]), loader=LOADER)
    assert len(kinds(p, PatchWorkload)) == 1 and p.status.cache.summary == "2"
    # wait: false fills alongside the rollout.
    m = cached(prewarm={"nodeSelector": {"pool": "h100"}, "wait": False})
    p = plan(m, observed(m, deployment(), prewarm=["gpu-a"]), loader=LOADER)
    assert kinds(p, FillNode) and kinds(p, PatchWorkload)


def test_fill_jobs_of_another_digest_or_of_a_cache_turned_off_go():
    m = cached()
    old = FillFacts("gpu-a", "sha256:" + "9" * 64, "Succeeded", finished_at=ago(), round=3, confirmed=True)
    assert kinds(plan(m, observed(m, wired(m), fills=[old]), loader=LOADER), RemoveFill) == [
        RemoveFill("gpu-a", old.digest, 3)]
    plain = parse({**manifest(), "metadata": {"name": "llama", "generation": 2, "namespace": "ml", "uid": "u-1"}})
    p = plan(plain, observed(plain, wired(plain), fills=[warm("gpu-a")]), loader=LOADER)
    assert kinds(p, RemoveFill) == [RemoveFill("gpu-a", DIGEST, 1)] and p.status.cache is None


def test_the_local_executor_cannot_cache_and_says_so():
    m = cached()
    obs = replace(observed(m, deployment()), fills=None)
    p = plan(m, obs, loader=LOADER)
    stalled = {c.type: (c.status, c.reason, c.message) for c in p.status.conditions}["Stalled"]
    assert stalled[:2] == ("True", "NodeCacheUnavailable") and "remove serving.nodeCache" in stalled[2]


@pytest.mark.parametrize("path,value,field,words", [
    ("format", {"type": "runai_streamer"}, "spec.serving.nodeCache",
     "format.type must be safetensors, sharded_state or runai_streamer_sharded, or runai_streamer with"),
    ("serving.localCopy", True, "spec.serving.nodeCache", "use one"),
])
def test_admission_names_the_field(path, value, field, words):
    obj = with_("serving.nodeCache", {"enabled": True}, with_(path, value))
    with pytest.raises(InvalidSpec) as info:
        parse(obj)
    assert field in str(info.value) and words in str(info.value)


def test_the_fill_job_runs_on_its_node_with_the_workers_rights_and_no_token():
    m = cached()
    settings = WorkerSettings(image="ferry.local/ferry:dev", service_account="ferry-worker",
                              node_selector={"pool": "cpu"}, tolerations=[{"key": "x", "operator": "Exists"}])
    artifact = Artifact(uri=FACTS.uri, format="sharded_state", total_bytes=FACTS.total_bytes, manifest_digest=DIGEST)
    job = fill_job_manifest(m, "u-1", "gpu-a", artifact, 2, settings)
    pod = job["spec"]["template"]["spec"]
    # Pinned through the scheduler, not nodeName; the chart's prepare-Job placement is not the fill's.
    assert "nodeName" not in pod and "nodeSelector" not in pod and "tolerations" not in pod
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}]}]
    assert pod["serviceAccountName"] == "ferry-worker" and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["source"]["persistentVolumeClaim"] == {"claimName": "llama-weights", "readOnly": True}
    assert volumes["cache-slot"]["csi"] == {"driver": "cache.ferry.dev", "volumeAttributes": {
        "digest": DIGEST, "mode": "fill", "bytes": str(3 << 30)}}
    (c,) = pod["containers"]
    assert c["args"] == ["cache", "fill-slot", "--slot", "/ferry/cache-slot", "--source", "/source/llama/abc",
                         "--digest", DIGEST]
    assert job["metadata"]["annotations"] == {"ferry.dev/node": "gpu-a", "ferry.dev/cache-digest": DIGEST,
                                              "ferry.dev/fill-round": "2"}
    assert {"name": "FERRY_RESULT_FILE", "value": "/dev/termination-log"} in c["env"]
    assert job["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_fill_facts_read_the_job_and_quote_the_failed_pods_error():
    from ferry_worker.cache.fill_slot import ALREADY_COMPLETE
    from ferry_operator.executors.cache_fill import ALREADY_COMPLETE as READ_AS_COMPLETE

    assert ALREADY_COMPLETE == READ_AS_COMPLETE
    meta = {"annotations": {"ferry.dev/node": "gpu-a", "ferry.dev/cache-digest": DIGEST, "ferry.dev/fill-round": "1"}}
    complete = {"metadata": meta, "status": {"completionTime": "2026-12-02T08:00:00Z",
                                             "conditions": [{"type": "Complete", "status": "True"}]}}
    done = fill_facts(complete, [])
    assert (done.node, done.digest, done.phase, done.finished_at, done.round) == ("gpu-a", DIGEST, "Succeeded", FIXED, 1)
    assert not done.confirmed
    found = {"status": {"phase": "Succeeded", "containerStatuses": [{"state": {"terminated": {
        "message": ALREADY_COMPLETE}}}]}}
    assert fill_facts(complete, [found]).confirmed
    pod = {"status": {"phase": "Failed", "containerStatuses": [{"state": {"terminated": {
        "message": "filling 3 files\nferry: cache failed: CacheError: no manifest\n"}}}]}}
    failed = fill_facts({"metadata": meta, "status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
         "lastTransitionTime": "2026-12-02T08:00:00Z"}]}}, [pod])
    assert failed.phase == "Failed" and "CacheError: no manifest" in failed.message and failed.finished_at == FIXED
    assert fill_facts({"metadata": meta, "status": {}}, []).phase == "Running"
    # A fill pod the scheduler cannot place says so (it goes through the scheduler: its node's room counts).
    pending = {"metadata": {"name": "fill-x"}, "status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 1 Insufficient cpu."}]}}
    waiting = fill_facts({"metadata": meta, "status": {}}, [pending])
    assert waiting.phase == "Running"
    assert waiting.message == "pod fill-x is not scheduled: Unschedulable 0/3 nodes are available: 1 Insufficient cpu."


def test_status_cache_is_written_and_cleared_by_the_status_patch():
    from ferry_operator.api.types import ModelWeightsStatus, NodeCacheStatus
    from ferry_operator.handlers import _status_patch

    cache = NodeCacheStatus(digest=DIGEST, warm_nodes=1, nodes=["gpu-a"], summary="1")
    patch = _status_patch({}, ModelWeightsStatus(cache=cache))
    assert patch["cache"] == {"digest": DIGEST, "warmNodes": 1, "fillingNodes": 0, "nodes": ["gpu-a"], "summary": "1",
                              "evictions": []}
    assert _status_patch({"cache": patch["cache"]}, ModelWeightsStatus())["cache"] is None


GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TEAM_B = {"key": "team", "value": "b", "effect": "NoSchedule"}
GPU_TEMPLATE = {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                "nodeSelector": {"pool": "h100"}}
POOL = {"gpu-a": NodeFacts("gpu-a", {"pool": "h100"}, [GPU_TAINT]),
        "gpu-b": NodeFacts("gpu-b", {"pool": "h100", "team": "b"}, [GPU_TAINT, TEAM_B])}
REFUSED_B = f"node gpu-b: taint team=b:NoSchedule is not tolerated by deployment {NAME}'s pod template"


def message(p, kind="Reconciling"):
    return {c.type: c.message for c in p.status.conditions}[kind]


def test_a_prewarm_fills_only_the_nodes_the_wired_pods_may_use_and_names_the_others():
    """gpu-b is dedicated to team b (a taint the workload does not tolerate): no fill goes there, the status
    says why, and the prewarm waits only for gpu-a."""
    m = cached(prewarm={"nodeSelector": {"pool": "h100"}})
    dep = deployment(placement=placement_of(GPU_TEMPLATE))
    p = plan(m, observed(m, dep, prewarm=["gpu-a", "gpu-b"], facts=POOL), loader=LOADER)
    (fill,) = kinds(p, FillNode)
    assert fill.node == "gpu-a" and fill.placement == dep.placement
    assert f"no fill on {REFUSED_B}" in message(p)
    assert "0/1 nodes hold the artifact (waiting for gpu-a" in message(p)
    p = plan(m, observed(m, dep, fills=[warm("gpu-a")], prewarm=["gpu-a", "gpu-b"], facts=POOL), loader=LOADER)
    assert len(kinds(p, PatchWorkload)) == 1 and not kinds(p, FillNode)  # gpu-b holds nothing up


def test_a_prewarm_that_selects_only_nodes_the_workload_may_not_use_stalls_naming_node_and_taint():
    m = cached(prewarm={"nodeSelector": {"team": "b"}})
    dep = deployment(placement=placement_of(GPU_TEMPLATE))
    p = plan(m, observed(m, dep, prewarm=["gpu-b"], facts=POOL), loader=LOADER)
    assert p.actions == []  # no fill Job, no patch
    stalled = {c.type: c for c in p.status.conditions}["Stalled"]
    assert (stalled.status, stalled.reason) == ("True", "PrewarmNodesRefused")
    assert REFUSED_B in stalled.message and "{'team': 'b'} selects only nodes" in stalled.message
    # A fill an earlier operator started there (pinned by nodeName, tolerating every taint) goes.
    old = FillFacts("gpu-b", DIGEST, "Running", round=0)
    p = plan(m, observed(m, dep, fills=[old], prewarm=["gpu-b"], facts=POOL), loader=LOADER)
    assert p.actions == [RemoveFill("gpu-b", DIGEST, 0)] and "gpu-b" in message(p, "Stalled")
    # A selector the template's own nodeSelector or required affinity rules out: the same.
    elsewhere = {"cpu-1": NodeFacts("cpu-1", {"team": "b", "pool": "cpu"})}
    p = plan(m, observed(m, dep, prewarm=["cpu-1"], facts=elsewhere), loader=LOADER)
    assert "node cpu-1: deployment llama-70b-vllm's pod template has nodeSelector pool=h100 and the node has " \
           "pool=cpu" in message(p, "Stalled")
    # No wired workload read (not created yet): nothing says its pods may go anywhere.
    seen = replace(observed(m, dep, prewarm=["gpu-a"], facts=POOL), workloads={NAME: None})
    assert "no wired workload's pod template was read" in message(plan(m, seen, loader=LOADER), "Stalled")


def test_a_pod_waiting_on_a_node_its_template_may_not_use_gets_no_fill_and_a_running_one_there_goes():
    """A pod placed by hand (nodeName) on another team's node, or a template that lost its toleration."""
    m = cached()
    dep = wired(m, deployment(placement=placement_of(GPU_TEMPLATE)))
    p = plan(m, observed(m, dep, pods=[waiting_pod("gpu-b")], facts=POOL), loader=LOADER)
    assert kinds(p, FillNode) == [] and f"no fill on {REFUSED_B}" in message(p)
    assert p.held  # it waits for a fix, which events announce: the handlers' poll backs off
    running = FillFacts("gpu-b", DIGEST, "Running", round=0)
    p = plan(m, observed(m, dep, pods=[waiting_pod("gpu-b")], fills=[running], facts=POOL), loader=LOADER)
    assert kinds(p, RemoveFill) == [RemoveFill("gpu-b", DIGEST, 0)] and kinds(p, FillNode) == []
    # A node the index does not hold (deleted): no fill either.
    p = plan(m, observed(m, dep, pods=[waiting_pod("gpu-z")], facts=POOL), loader=LOADER)
    assert kinds(p, FillNode) == [] and "node gpu-z: the operator's node index does not hold it" in message(p)


def test_an_lws_leader_template_may_place_a_fill_its_worker_template_may_not():
    m = cached(prewarm={"nodeSelector": {"pool": "h100"}})
    leader = replace(deployment(), placement=placement_of({"tolerations": [
        {"key": "nvidia.com/gpu", "operator": "Exists"}]}))
    dep = replace(deployment(), leader=leader)  # the worker template tolerates nothing
    only_a = {"gpu-a": POOL["gpu-a"]}
    (fill,) = kinds(plan(m, observed(m, dep, prewarm=["gpu-a"], facts=only_a), loader=LOADER), FillNode)
    assert fill.placement == leader.placement and dep.placement.tolerations == []


def test_without_the_node_agent_no_fill_job_is_made_and_the_status_says_why():
    m = cached(prewarm={"nodeSelector": {"pool": "h100"}})
    obs = replace(observed(m, deployment(), pods=[waiting_pod("gpu-a")], prewarm=["gpu-a"]), node_agent=False)
    p = plan(m, obs, loader=LOADER)
    assert p.actions == []
    stalled = {c.type: c for c in p.status.conditions}["Stalled"]
    assert (stalled.status, stalled.reason) == ("True", "NodeCacheUnavailable")
    assert "installed without its node agent (the chart's nodeCache.enabled is false)" in stalled.message


def test_the_fill_job_carries_the_templates_placement_pinned_to_its_node_and_no_toleration_of_every_taint():
    m = cached()
    settings = WorkerSettings(image="ferry.local/ferry:dev", node_selector={"pool": "cpu"},
                              tolerations=[{"operator": "Exists"}])
    template = {"nodeSelector": {"pool": "h100"},
                "tolerations": [{"operator": "Exists"}, {"key": "nvidia.com/gpu", "operator": "Exists"}],
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}]}},
                    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": {"app": NAME}}, "topologyKey": "kubernetes.io/hostname"}]}}}
    artifact = Artifact(uri=FACTS.uri, format="sharded_state", total_bytes=FACTS.total_bytes, manifest_digest=DIGEST)
    pod = fill_job_manifest(m, "u-1", "gpu-a", artifact, 0, settings, placement_of(template))["spec"]["template"][
        "spec"]
    assert "nodeName" not in pod and pod["nodeSelector"] == {"pool": "h100"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert not [t for t in pod["tolerations"] if t.get("operator") == "Exists" and not t.get("key")]
    # The template's terms, each narrowed to the node; its pod anti-affinity (about its own pods) is not carried.
    assert pod["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}],
                               "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}]}]}}}


def test_a_fill_jobs_deadline_is_capped_whatever_the_claim_size():
    """A fill Job (and the room its slot reserves on the node) lives at most the chart's
    nodeCache.fillDeadlineSeconds: a tenant's storage.pvc.size does not stretch it to years."""
    huge = parse({**(obj := with_("serving.nodeCache", {"enabled": True})), "spec": {
        **obj["spec"], "storage": {**(obj["spec"].get("storage") or {}), "pvc": {"size": "900Ti"}}},
        "metadata": {**obj["metadata"], "generation": 2, "namespace": "ml", "uid": "u-1"}})
    artifact = Artifact(uri=FACTS.uri, format="sharded_state", total_bytes=FACTS.total_bytes, manifest_digest=DIGEST)
    settings = WorkerSettings(image="ferry.local/ferry:dev", fill_deadline_seconds=7200)
    job = fill_job_manifest(huge, "u-1", "gpu-a", artifact, 0, settings, placement_of({}))
    assert job["spec"]["activeDeadlineSeconds"] == 7200
    from ferry_operator.executors.jobs import prepare_deadline

    roomy = replace(settings, fill_deadline_seconds=10 ** 6)  # a cap above the derived deadline leaves it be
    small = fill_job_manifest(cached(), "u-1", "gpu-a", artifact, 0, roomy, placement_of({}))
    assert small["spec"]["activeDeadlineSeconds"] == prepare_deadline(cached(), roomy) < 10 ** 6


def test_a_prewarm_may_select_only_by_the_labels_the_admin_lists():
    """The chart's nodeCache.prewarmNodeLabels: a prewarm selecting by another label stalls, naming it and
    the allowed ones, and makes no fill Job; unset, any label (placement still applies)."""
    m = cached(prewarm={"nodeSelector": {"team": "b"}})
    dep = deployment(placement=placement_of(GPU_TEMPLATE))
    listed = replace(observed(m, dep, prewarm=["gpu-a"], facts=POOL), prewarm_labels=("ferry.dev/pool",))
    p = plan(m, listed, loader=LOADER)
    assert p.actions == []
    stalled = {c.type: c for c in p.status.conditions}["Stalled"]
    assert (stalled.status, stalled.reason) == ("True", "PrewarmLabelNotAllowed")
    assert "selects by team, a label the cluster admin does not let prewarms select by" in stalled.message
    assert "nodeCache.prewarmNodeLabels: ferry.dev/pool" in stalled.message
    allowed = replace(listed, prewarm_labels=("team", "ferry.dev/pool"))
    assert "PrewarmLabelNotAllowed" not in {c.reason for c in plan(m, allowed, loader=LOADER).status.conditions}
