"""LeaderWorkerSets and StatefulSets as serving targets on the real node (issue 18): LWS's own controller
(a host process of the local cluster, e2e/localcluster_lws.py) makes a group of two pods, leader and
worker, from the templates the chart's operator wired for a PP 2 artifact, and each pod's loader verifies
only its own pipeline stage; the same for a StatefulSet of two replicas forming one group.

Both run with serving.compiledState on: each pod of a group keeps and restores its own entry (the
stand-in "compiles" into its cache root: COLD, or WARM with what it found). Shared: the session's node,
chart operator, S3 server and tiny checkpoint (fixtures); each test makes its own workload and object.

The serving process is the busybox stand-in (node_support.STANDIN: it prints the argv it got, after the
kubelet expanded $(FERRY_GROUP_INDEX) and $(LWS_LEADER_ADDRESS), and answers /health); what vLLM makes
of those argvs is proven by vLLM's own parser in tests/test_serving_vllm.py, and a real two-pod vLLM
engine on an LWS by tests/node/test_vllm_on_node.py.
"""
from __future__ import annotations

import json

import pytest

import localcluster
from cluster_support import wait_for
from node_support import (NAMESPACE, claim_dir, condition, modelweights, mw_status, s3_secret, standin_template,
                          unique, upload_dir, wait_ready)

pytestmark = [pytest.mark.cluster, pytest.mark.node]
GATE = "ferry.dev/weights-loaded"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"


def lws(kube, name: str) -> dict:
    template = standin_template(kube, name)
    return {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2, "leaderTemplate": template,
                                                             "workerTemplate": template}}}


def group_pods(kube, name: str) -> dict[int, dict]:
    """worker index -> the live pod of the LWS's group 0."""
    pods = kube.get_json("pods", "-n", NAMESPACE, "-l", f"{LWS_NAME}={name}")["items"]
    return {int(p["metadata"]["labels"].get(WORKER_INDEX, -1)): p for p in pods
            if not p["metadata"].get("deletionTimestamp")}


def operator_writes(name: str) -> list[dict]:
    """The chart operator's successful writes of LWS `name` (audit log: service accounts' LWS writes)."""
    return [e for e in localcluster.audit_events()
            if e.get("objectRef", {}).get("resource") == "leaderworkersets" and e["objectRef"].get("name") == name
            and e["user"]["username"].startswith("system:serviceaccount:ferry-node-system:")
            and e.get("responseStatus", {}).get("code") == 200]


def serving_started(pod: dict) -> bool:
    """The stand-in vLLM container runs (after the loader): its log holds the argv it got."""
    return any(c["name"] == "vllm" and c.get("state", {}).get("running")
               for c in pod["status"].get("containerStatuses") or [])


def gate(pod: dict) -> dict:
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == GATE), {})


def loader_result(pod: dict) -> dict:
    (loader,) = [s for s in pod["status"]["initContainerStatuses"] if s["name"] == "ferry-load"]
    return json.loads(loader["state"]["terminated"]["message"])


def artifact_dir(kube, status: dict):
    claim, _, path = status["artifact"]["uri"].removeprefix("pvc://").partition("/")
    return claim_dir(kube, claim) / path


def stage_files(manifest: dict, ranks: list[int], tp: int) -> set[str]:
    """The files pod ranks `ranks` need: theirs, plus every file of no rank (config, tokenizer)."""
    rank_files = manifest["extra"]["rankFiles"]
    owned = {f for files in rank_files.values() for f in files}
    mine = {f for r in ranks for f in rank_files[f"pp{r // tp}-tp{r % tp}"]}
    return mine | {e["path"] for e in manifest["files"] if e["path"] not in owned}


def wait_group_loaded(kube, name: str, digest: str) -> dict[int, dict]:
    def loaded():
        pods = group_pods(kube, name)
        ready = all(p["metadata"]["annotations"].get("ferry.dev/artifact-digest") == digest
                    and gate(p).get("status") == "True" and serving_started(p) for p in pods.values())
        return pods if len(pods) == 2 and ready else None
    return wait_for(loaded, f"both pods of {name}'s group loaded {digest[:19]}", 300)


def vllm_log(kube, pod: dict) -> str:
    return kube.kubectl("logs", pod["metadata"]["name"], "-n", NAMESPACE, "-c", "vllm").stdout


def compile_line(kube, pod: dict) -> str:
    """What the stand-in found in its cache root: COLD, or WARM and who compiled it."""
    return next(w for w in vllm_log(kube, pod).splitlines() if w.split(" ")[0] in ("COLD", "WARM"))


def harvests_published(kube, name: str, pods_of=None) -> dict[int, dict] | None:
    """The group's pods once each one's harvest kept its state (the worker's waits for the leader).
    `pods_of`: index -> pod of the group (an LWS's group 0 by default)."""
    pods = (pods_of or group_pods)(kube, name)
    logs = {i: kube.kubectl("logs", p["metadata"]["name"], "-n", NAMESPACE, "-c", "ferry-compiled-harvest",
                            check=False).stdout for i, p in pods.items()}
    return pods if len(pods) == 2 and all("compiled state published" in log for log in logs.values()) else None


def describe_group(kube, name: str, pods_of=None) -> str:
    """What a failed wait prints: the group's pods (phase, conditions, container states) and the status."""
    lines = []
    for i, p in sorted((pods_of or group_pods)(kube, name).items()):
        states = {c["name"]: list(c.get("state", {}))[:1] + [c.get("restartCount", 0)]
                  for c in p["status"].get("initContainerStatuses", []) + p["status"].get("containerStatuses", [])}
        conditions = {c["type"]: c["status"] for c in p["status"].get("conditions", [])}
        lines.append(f"pod {i} {p['metadata']['name']} {p['status'].get('phase')} {conditions} {states}")
    lines.append(json.dumps(mw_status(kube, NAMESPACE, name), indent=1)[:6000])
    lines.append(kube.kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp", check=False).stdout[-4000:])
    return "\n".join(lines)


def test_a_leaderworkerset_group_loads_one_pipeline_stage_per_pod(node, chart_operator, node_s3, checkpoint):
    name = unique("lws")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    node.apply(lws(node, name))
    mw = modelweights(name, f"s3://{name}/tiny-llama", {"type": "sharded_state", "pipelineParallelSize": 2,
                                                         "vllmVersion": "0.32"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"targets": [{"kind": "LeaderWorkerSet", "name": name, "container": "vllm",
                                          "groupSize": 2}], "compiledState": {"mode": "AfterFirstReady"}}
    node.apply(mw)
    status = wait_ready(node, NAMESPACE, name, timeout=420)
    digest = status["artifact"]["manifestDigest"]
    loaded = condition(status, "WeightsLoaded")
    assert loaded["status"] == "True" and loaded["message"].startswith("2/2 pods loaded, 1/1 groups"), loaded

    # Each pod's loader verified exactly its stage's rank files (its result and the manifest agree).
    manifest = json.loads((artifact_dir(node, status) / "ferry-manifest.json").read_text())
    pods = wait_group_loaded(node, name, digest)
    sizes = {e["path"]: e["size"] for e in manifest["files"]}
    for index, pod in pods.items():
        result = loader_result(pod)
        assert (result["groupSize"], result["groupIndex"], result["ranks"]) == (2, index, [index]), result
        want = stage_files(manifest, [index], tp=1)
        assert result["files"] == len(want) and result["totalBytes"] == sum(sizes[f] for f in want), result
        assert f"pipeline stage {index}" in gate(pod)["message"], gate(pod)
        # vLLM's multi-node flags, as the kubelet expanded them for this pod.
        line = next(w for w in vllm_log(node, pod).splitlines() if w.startswith("vllm "))
        assert f"--nnodes 2 --node-rank {index} --master-addr {name}-0.{name}.{NAMESPACE}" in line, line
        assert ("--headless" in line) is (index == 1), line
    # Compiled state on: each pod "compiled" its own ranks.
    assert [compile_line(node, pods[i]) for i in (0, 1)] == ["COLD", "COLD"]

    # A spec change (TP 1 -> 2: four ranks, two per pod) rolls the group once, onto the new artifact:
    # the operator writes the LWS's templates once (the API server's audit log), LWS recreates the group.
    leader_uid = pods[0]["metadata"]["uid"]
    wirings = len(operator_writes(name))
    before_keys = {(mw_status(node, NAMESPACE, name).get("compiledState") or {}).get("key")}
    node.kubectl("patch", "mw", name, "-n", NAMESPACE, "--type=merge", "-p",
                 json.dumps({"spec": {"format": {"tensorParallelSize": 2}}}))
    try:
        status = wait_for(lambda: (s := mw_status(node, NAMESPACE, name)).get("artifact", {}).get("manifestDigest")
                          not in (None, digest) and condition(s, "Ready").get("status") == "True" and s,
                          f"{name} Ready on the TP 2 artifact", 420)
    except AssertionError:
        print(describe_group(node, name))
        raise
    new_digest = status["artifact"]["manifestDigest"]
    pods = wait_group_loaded(node, name, new_digest)
    assert pods[0]["metadata"]["uid"] != leader_uid
    assert len(operator_writes(name)) == wirings + 1, operator_writes(name)
    revisions = {p["metadata"]["labels"]["leaderworkerset.sigs.k8s.io/template-revision-hash"]
                 for p in pods.values()}
    assert len(revisions) == 1
    assert [loader_result(pods[i])["ranks"] for i in (0, 1)] == [[0, 1], [2, 3]]
    # New weights and a new command line make a new key: both pods compile afresh, and the status says why.
    assert [compile_line(node, pods[i]) for i in (0, 1)] == ["COLD", "COLD"]
    compiled = wait_for(lambda: (c := mw_status(node, NAMESPACE, name).get("compiledState") or {}).get("key")
                        and "weights, command line changed" in c.get("message", "") and c,
                        "the status naming what changed the key", 60)
    assert compiled["key"] not in before_keys, compiled

    # Each pod's harvest keeps its own entry (the worker's once the leader serves); when the group is
    # recreated (its leader deleted: LWS recreates the group), each new pod restores its own.
    try:
        published = wait_for(lambda: harvests_published(node, name), "both harvests to publish", 120)
    except AssertionError:
        print(describe_group(node, name))
        raise
    node.kubectl("delete", "pod", published[0]["metadata"]["name"], "-n", NAMESPACE, "--wait=false")
    uids = {p["metadata"]["uid"] for p in published.values()}

    def recreated():
        now = group_pods(node, name)
        fresh = len(now) == 2 and not uids & {p["metadata"]["uid"] for p in now.values()}
        return now if fresh and all(gate(p).get("status") == "True" and serving_started(p)
                                    for p in now.values()) else None
    pods = wait_for(recreated, "the group recreated and loaded", 180)
    for i, pod in pods.items():
        assert compile_line(node, pod) == f"WARM compiled-by-{published[i]['metadata']['name']}", i
        assert "compiled state restored" in gate(pod)["message"], gate(pod)

    # A corrupt stage-1 file fails only the stage-1 pod, naming it, and the group does not turn Ready.
    manifest = json.loads((artifact_dir(node, status) / "ferry-manifest.json").read_text())
    victim = sorted(manifest["extra"]["rankFiles"]["pp1-tp0"])[0]
    path = artifact_dir(node, status) / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    node.kubectl("delete", "pod", pods[1]["metadata"]["name"], "-n", NAMESPACE, "--wait=false")

    def stage1_failed():
        now = group_pods(node, name)
        worker = now.get(1)
        return now if worker and gate(worker).get("reason") == "VerificationFailed" else None
    now = wait_for(stage1_failed, "the stage-1 pod's loader to refuse the corrupt file", 300)
    assert victim in gate(now[1])["message"], gate(now[1])
    wait_for(lambda: gate(group_pods(node, name).get(0, {"status": {}})).get("status") == "True",
             "the stage-0 pod loaded", 180)

    def stalled():
        s = mw_status(node, NAMESPACE, name)
        c = condition(s, "WeightsLoaded")
        return s if c.get("status") == "False" and victim in c.get("message", "") else None
    s = wait_for(stalled, "WeightsLoaded False naming the stage-1 file", 120)
    assert condition(s, "WeightsLoaded")["reason"] == "VerificationFailed"
    assert condition(s, "Ready").get("status") != "True"


def test_a_statefulset_group_loads_one_pipeline_stage_per_ordinal(node, chart_operator, node_s3, checkpoint):
    """A StatefulSet of 2 replicas as one group (groupSize 2): pod i (its ordinal, the kubelet's
    apps.kubernetes.io/pod-index label) loads pipeline stage i; vLLM's --master-addr is pod 0's DNS name
    under the StatefulSet's headless Service."""
    name = unique("sts")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    node.apply({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"clusterIP": "None", "selector": {"app": name}, "ports": [{"port": 8000}]}})
    node.apply({"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"replicas": 2, "serviceName": name, "podManagementPolicy": "Parallel",
                         "selector": {"matchLabels": {"app": name}}, "template": standin_template(node, name)}})
    mw = modelweights(name, f"s3://{name}/tiny-llama", {"type": "sharded_state", "pipelineParallelSize": 2,
                                                         "vllmVersion": "0.32"}, secret=f"{name}-s3")
    mw["spec"]["serving"] = {"targets": [{"kind": "StatefulSet", "name": name, "container": "vllm", "groupSize": 2}],
                             "compiledState": {"mode": "AfterFirstReady"}}
    node.apply(mw)
    status = wait_ready(node, NAMESPACE, name, timeout=420)
    loaded = condition(status, "WeightsLoaded")
    assert loaded["status"] == "True" and loaded["message"].startswith("2/2 pods loaded, 1/1 groups"), loaded

    def ordinals(kube, app):
        return {int(p["metadata"]["labels"]["apps.kubernetes.io/pod-index"]): p
                for p in kube.get_json("pods", "-n", NAMESPACE, "-l", f"app={app}")["items"]
                if not p["metadata"].get("deletionTimestamp")}

    def started(uids=frozenset()):
        pods = ordinals(node, name)
        return pods if len(pods) == 2 and all(serving_started(p) and gate(p).get("status") == "True"
                                              and p["metadata"]["uid"] not in uids for p in pods.values()) else None
    pods = wait_for(started, f"both pods of {name} loaded and serving", 180)
    for ordinal, pod in pods.items():
        result = loader_result(pod)
        assert (result["groupSize"], result["groupIndex"], result["ranks"]) == (2, ordinal, [ordinal]), result
        log = node.kubectl("logs", pod["metadata"]["name"], "-n", NAMESPACE, "-c", "vllm").stdout
        line = next(w for w in log.splitlines() if w.startswith("vllm "))
        assert f"--nnodes 2 --node-rank {ordinal} --master-addr {name}-0.{name}" in line, line

    # Compiled state on: each ordinal "compiled" its own ranks, and each harvest keeps its own entry (pod 1's
    # waits for pod 0's /health at the --master-addr name). Both pods deleted: the StatefulSet makes them
    # anew, and each restores its own ordinal's entry, not the other's.
    assert [compile_line(node, pods[i]) for i in (0, 1)] == ["COLD", "COLD"]
    try:
        published = wait_for(lambda: harvests_published(node, name, ordinals), "both harvests to publish", 120)
    except AssertionError:
        print(describe_group(node, name, ordinals))
        raise
    node.kubectl("delete", "pod", *(p["metadata"]["name"] for p in published.values()), "-n", NAMESPACE,
                 "--wait=false")
    pods = wait_for(lambda: started(frozenset(p["metadata"]["uid"] for p in published.values())),
                    f"both pods of {name} made anew, loaded and serving", 180)
    for i, pod in pods.items():
        assert compile_line(node, pod) == f"WARM compiled-by-{name}-{i}", i
        assert "compiled state restored" in gate(pod)["message"], gate(pod)
