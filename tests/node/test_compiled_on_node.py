"""serving.compiledState on the real node: the first wired pod's compile caches are kept by Ferry's harvest
sidecar once it serves, and the next pod starts with them restored and verified by its loader; a corrupt
state is refused (the pod compiles; the next harvest replaces it); a changed command line makes a new key
and the status names what changed; under BeforeRollout the next change is compiled by a warm-up Job first
and the rolled pod starts warm; a warm-up Job the API server refuses (a quota) does not hold the rollout;
another namespace cannot mount the store; a tag that moves between two pods' starts is named in the status;
an S3 artifact's state is kept in S3 beside it (also when the node
cache serves the weights) and deleted with it.

Shares the module-scoped chart operator, S3 server and checkpoint of the node lane (tests/node/conftest.py),
and one ModelWeights for the claim's steps (another for S3's). The serving process is a busybox stand-in for
vLLM, as in test_serving_failures_on_node.py: it "compiles" (writes files under $VLLM_CACHE_ROOT) when it finds none
and says WARM with what it found otherwise, so what vLLM would see is asserted, at the cost of seconds per
pod instead of minutes. vLLM's own use of a restored cache is measured by bench/compile_cache_node.py.
The moved-tag step imports no image: it points a tag of its own at the busybox and ferry images the node
already holds (`ctr images tag`) and adds one replica.
"""
from __future__ import annotations

import json
import subprocess

import pytest

import localcluster
from cluster_support import wait_for
from ferry_operator.serving.weights_loaded import pod_facts
from node_support import (NAMESPACE, claim_dir, condition, modelweights, mw_status, s3_secret, unique,
                          upload_dir)
from test_serving_failures_on_node import deployment, wired_modelweights

pytestmark = [pytest.mark.cluster, pytest.mark.node]

COMPILING = """#!/bin/sh
root="$VLLM_CACHE_ROOT/torch_compile_cache/standin/rank_0_0"
if [ -f "$root/graph.py" ]; then
  echo "WARM $(cat "$root/graph.py")"
else
  echo "COLD"
  mkdir -p "$root/inductor"
  echo "compiled-by-$HOSTNAME" > "$root/graph.py"
  head -c 200000 /dev/urandom > "$root/inductor/kernel.so"
fi
mkdir -p /tmp/www && echo ok > /tmp/www/health
trap 'exit 0' TERM  # as the pod's PID 1, httpd would ignore SIGTERM: each pod would take its 30 s grace to go
httpd -f -p 8000 -h /tmp/www &
wait
"""


def current_pod(kube, name: str) -> dict:
    """The Deployment's one pod once it is the only one, wired by Ferry, and Ready."""
    def one():
        pods = kube.get_json("pods", "-n", NAMESPACE, "-l", f"app={name}")["items"]
        ready = [p for p in pods if not p["metadata"].get("deletionTimestamp")
                 and (p["metadata"].get("annotations") or {}).get("ferry.dev/modelweights") == name
                 and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]
        return ready[0] if len(ready) == 1 and len(pods) == 1 else None
    return wait_for(one, f"one wired, Ready pod of {name}", 240)


def logs(kube, pod: dict, container: str) -> str:
    return kube.kubectl("logs", pod["metadata"]["name"], "-n", NAMESPACE, "-c", container).stdout


def loader_message(pod: dict) -> str:
    return next(c.get("message", "") for c in pod["status"]["conditions"] if c["type"] == "ferry.dev/weights-loaded")


def harvested(kube, pod: dict) -> str:
    return wait_for(lambda: next((line for line in logs(kube, pod, "ferry-compiled-harvest").splitlines()
                                  if "compiled state" in line), None), "the harvest sidecar's outcome", 120)


def restart(kube, name: str) -> dict:
    before = current_pod(kube, name)["metadata"]["name"]
    kube.kubectl("rollout", "restart", f"deployment/{name}", "-n", NAMESPACE)
    return wait_for(lambda: (lambda p: p if p["metadata"]["name"] != before else None)(current_pod(kube, name)),
                    f"a new pod of {name}", 240)


def status_message(kube, name: str, words: str) -> dict:
    def found():
        c = mw_status(kube, NAMESPACE, name).get("compiledState") or {}
        return c if words in c.get("message", "") else None
    return wait_for(found, f"status.compiledState saying {words!r}", 120)


def test_compiled_state_is_kept_restored_refused_when_corrupt_and_rekeyed(node, chart_operator, node_s3,
                                                                          checkpoint):
    name = unique("compiled")
    deployment(node, name, script=COMPILING)
    wired_modelweights(node, node_s3, checkpoint, name, compiledState={"mode": "AfterFirstReady"})
    first = current_pod(node, name)
    assert logs(node, first, "vllm").startswith("COLD")
    assert "compiled state absent" in loader_message(first)
    assert "compiled state published" in harvested(node, first)
    vllm = next(c for c in first["spec"]["containers"] if c["name"] == "vllm")
    assert {"name": "VLLM_CACHE_ROOT", "value": "/ferry/compiled"} in vllm["env"]
    assert "ferry-compiled-store" not in [m["name"] for m in vllm["volumeMounts"]]  # vLLM never writes the store
    # The bytes each container runs from, as the kubelet reports them (what a moved tag is told by).
    image_ids = dict(pod_facts(first).image_ids)
    assert image_ids.keys() >= {"vllm"} and image_ids["vllm"].rpartition("sha256:")[2].isalnum(), image_ids

    warm = restart(node, name)
    assert logs(node, warm, "vllm").strip() == f"WARM compiled-by-{first['metadata']['name']}"
    assert "compiled state restored" in loader_message(warm)
    status = wait_for(lambda: (mw_status(node, NAMESPACE, name).get("compiledState") or {}).get(
        "restoredReplicas") == 1 and mw_status(node, NAMESPACE, name)["compiledState"], "restoredReplicas 1", 120)
    key = status["key"]
    assert "present" in harvested(node, warm)  # published once

    # One flipped byte in the stored state: refused, the pod compiles, its harvest replaces the entry.
    uid = node.get_json("modelweights", name, "-n", NAMESPACE)["metadata"]["uid"]
    (state,) = (claim_dir(node, f"{name}-weights") / name / uid / "compiled" / key).glob("*/state.tar")
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    corrupt = restart(node, name)
    assert logs(node, corrupt, "vllm").startswith("COLD")
    assert "failed verification" in loader_message(corrupt)
    status_message(node, name, "failed verification")
    assert "compiled state published" in harvested(node, corrupt)  # the damaged entry replaced

    # The user's command line changes: a new key, and the status says what changed.
    node.kubectl("patch", "deployment", name, "-n", NAMESPACE, "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--seed=1"}]))
    status = status_message(node, name, "command line changed")
    assert status["key"] != key
    rekeyed = wait_for(lambda: (lambda p: p if "--seed=1" in next(
        c for c in p["spec"]["containers"] if c["name"] == "vllm")["args"] and "compiled state" in
        loader_message(p) else None)(current_pod(node, name)), "the re-keyed pod", 240)
    assert logs(node, rekeyed, "vllm").startswith("COLD")
    assert "compiled state absent" in loader_message(rekeyed)
    wait_for(lambda: condition(mw_status(node, NAMESPACE, name), "Ready").get("status") == "True", "Ready", 120)

    # BeforeRollout: the next command line is compiled by a warm-up Job before Ferry rolls to it, and the
    # rolled pod starts warm with what the Job's pod compiled. (current_pod also checks that the Job's pod is
    # not one of the Deployment's: it does not carry the selector's labels.)
    node.kubectl("patch", "mw", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(
        {"spec": {"serving": {"compiledState": {"mode": "BeforeRollout"}}}}))
    node.kubectl("patch", "deployment", name, "-n", NAMESPACE, "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--seed=2"}]))
    warm_up = wait_for(lambda: next((j for j in node.get_json(
        "jobs", "-n", NAMESPACE, "-l", f"ferry.dev/modelweights={name},ferry.dev/step=compiled-warm-up")["items"]
        if any(c["type"] == "Complete" and c["status"] == "True" for c in j["status"].get("conditions", []))),
        None), "the warm-up Job complete", 240)
    (job_pod,) = node.get_json("pods", "-n", NAMESPACE, "-l", f"job-name={warm_up['metadata']['name']}")["items"]
    assert logs(node, job_pod, "vllm").startswith("COLD")
    assert "compiled state published" in logs(node, job_pod, "ferry-compiled-harvest")
    key = warm_up["metadata"]["labels"]["ferry.dev/compiled-key"]
    warmed = wait_for(lambda: (lambda p: p if key in next(
        c for c in p["spec"]["initContainers"] if c["name"] == "ferry-load")["args"] and "compiled state" in
        loader_message(p) else None)(current_pod(node, name)), "the pod Ferry rolled after the warm-up", 240)
    assert logs(node, warmed, "vllm").strip() == f"WARM compiled-by-{job_pod['metadata']['name']}"
    assert "compiled state restored" in loader_message(warmed)
    status = wait_for(lambda: (lambda c: c if c.get("restoredReplicas") == 1 else None)(
        mw_status(node, NAMESPACE, name).get("compiledState") or {}), "the warm pod counted", 120)
    assert status["warmed"] == [key] == [status["key"]]

    # A warm-up Job the API server refuses (a quota of no Jobs) is a failed warm-up: the next change rolls at
    # once (its pod compiles), no Job is made, and the status quotes the API server.
    node.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-jobs", "namespace": NAMESPACE},
                "spec": {"hard": {"count/jobs.batch": "0"}}})
    try:
        wait_for(lambda: (node.get_json("resourcequota", "no-jobs", "-n", NAMESPACE).get("status") or {}).get(
            "hard"), "the quota counted by its controller", 60)
        node.kubectl("patch", "deployment", name, "-n", NAMESPACE, "--type=json", "-p", json.dumps([
            {"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--seed=3"}]))
        said = status_message(node, name, "the API server refused to create it")["message"]
        assert "exceeded quota: no-jobs" in said and "the rollout went on without it" in said, said
        rolled = wait_for(lambda: (lambda p: p if "--seed=3" in next(
            c for c in p["spec"]["containers"] if c["name"] == "vllm")["args"] and "compiled state" in
            loader_message(p) else None)(current_pod(node, name)), "the pod rolled without a warm-up", 240)
        assert logs(node, rolled, "vllm").startswith("COLD")
        jobs = node.get_json("jobs", "-n", NAMESPACE, "-l", f"ferry.dev/modelweights={name},"
                                                              f"ferry.dev/step=compiled-warm-up")["items"]
        assert [j["metadata"]["labels"]["ferry.dev/compiled-key"] for j in jobs] in ([], [key]), jobs
    finally:
        node.kubectl("delete", "resourcequota", "no-jobs", "-n", NAMESPACE, check=False)

    # The store is a directory of the owner's claim: a pod in another namespace cannot name that claim.
    other = unique("other-ns")
    claim = f"{name}-weights"
    node.kubectl("create", "namespace", other)
    try:
        node.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "reader", "namespace": other},
                    "spec": {"containers": [{"name": "c", "image": "busybox", "command": ["true"]}],
                             "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": claim}}]}})

        def refused():
            pod = node.get_json("pod", "reader", "-n", other)
            scheduled = next((c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"), {})
            return scheduled if scheduled.get("status") == "False" else None
        found = wait_for(refused, "the other namespace's pod refused", 60)
        assert "not found" in found.get("message", ""), found
    finally:
        node.kubectl("delete", "namespace", other, "--wait=false")

    moved_tag_is_named(node, name)


def tag_on_node(source: str, tag: str) -> None:
    """Point `tag` at the image `source` names in the node's containerd (as a registry's tag moves)."""
    subprocess.run(["ctr", "--address", str(localcluster.node_paths().containerd_sock), "-n", "k8s.io", "images",
                    "tag", "--force", source, tag], check=True, capture_output=True)


def moved_tag_is_named(node, name: str) -> None:
    """The Deployment runs a tag, which then moves to other bytes before its second replica starts: the
    kubelet reports two imageIDs for the one reference, and the status names the move and the way out."""
    built = localcluster.built_images()
    moving = f"ferry.local/{name}:moving"
    tag_on_node(built["busybox"]["ref"], moving)
    node.kubectl("patch", "mw", name, "-n", NAMESPACE, "--type=merge", "-p", json.dumps(
        {"spec": {"serving": {"compiledState": {"mode": "AfterFirstReady"}}}}))
    node.kubectl("set", "image", f"deployment/{name}", f"vllm={moving}", "-n", NAMESPACE)
    key = status_message(node, name, "image changed")["key"]
    wait_for(lambda: (lambda p: p if key in next(c for c in p["spec"]["initContainers"] if c["name"] == "ferry-load")[
        "args"] else None)(current_pod(node, name)), "the pod of the moving tag", 240)
    tag_on_node(built["ferry"]["ref"], moving)  # other bytes, under the same name
    node.kubectl("scale", f"deployment/{name}", "--replicas=2", "-n", NAMESPACE)
    said = status_message(node, name, "the tag moved")["message"]
    assert f"the pods run {moving} as 2 different images" in said and f"{moving}@sha256:" in said, said
    ids = {dict(pod_facts(p).image_ids).get("vllm") for p in node.get_json(
        "pods", "-n", NAMESPACE, "-l", f"app={name}")["items"]}
    assert len(ids - {None}) == 2, ids


def test_an_s3_artifacts_compiled_state_is_kept_in_s3_beside_it_and_deleted_with_it(node, chart_operator, node_s3,
                                                                                   checkpoint):
    """runai_streamer published to storage.s3: the store is in S3 beside the artifact. The first pod compiles
    and its harvest writes the tar and then the manifest; the next pod restores from S3 (WARM, the same
    bytes); with the node cache serving the weights, the state stays in S3 (vLLM holds no S3 credentials,
    Ferry's loader and harvest do); deleting the ModelWeights (deletionPolicy Delete) empties the compiled
    prefix."""
    name = unique("s3compiled")
    upload_dir(node_s3, name, "tiny-llama", checkpoint)
    s3_secret(node, NAMESPACE, f"{name}-s3", node_s3)
    deployment(node, name, script=COMPILING)
    mw = modelweights(name, f"s3://{name}/tiny-llama", {"type": "runai_streamer", "vllmVersion": "0.32"},
                      secret=f"{name}-s3")
    mw["spec"]["storage"]["s3"] = {"uri": f"s3://{name}/artifacts", "endpoint": node_s3.endpoint,
                                   "credentialsSecretRef": {"name": f"{name}-s3"}}
    mw["spec"]["serving"] = {"deployments": [{"name": name, "container": "vllm"}],
                             "compiledState": {"mode": "AfterFirstReady"}}
    node.apply(mw)
    first = current_pod(node, name)
    assert logs(node, first, "vllm").startswith("COLD")
    assert "compiled state published" in harvested(node, first)
    uid = node.get_json("modelweights", name, "-n", NAMESPACE)["metadata"]["uid"]
    prefix = f"artifacts/{NAMESPACE}/{name}/{uid}/compiled/"
    client = node_s3.client()

    def stored() -> list[str]:
        return sorted(o["Key"].removeprefix(prefix) for o in client.list_objects_v2(
            Bucket=name, Prefix=prefix).get("Contents") or [])
    (manifest, tar) = stored()  # sorted: compiled.json, state-<sha16>.tar
    assert tar.endswith(".tar") and manifest.endswith("/compiled.json"), (tar, manifest)

    warm = restart(node, name)
    assert logs(node, warm, "vllm").strip() == f"WARM compiled-by-{first['metadata']['name']}"
    assert "compiled state restored" in loader_message(warm)
    # The warm pod's harvest finds the entry (published once). Waited for before the deletion: a serving pod
    # that outlives its ModelWeights and harvests after it would keep its state once more (docs/security.md).
    assert "compiled state present" in harvested(node, warm)

    # The node cache serves the weights (serving.nodeCache): vLLM holds no S3 credentials any more; the loader
    # and the harvest keep the store's, by named keys. --model is now the node's entry, a new key: the rolled
    # pod compiles and publishes, and the next one restores from S3.
    try:
        node.kubectl("patch", "modelweights", name, "-n", NAMESPACE, "--type=merge", "-p",
                     json.dumps({"spec": {"serving": {"nodeCache": {"enabled": True}}}}))
        cached = wait_for(lambda: (lambda p: p if p["metadata"]["name"] != warm["metadata"]["name"] else None)(
            current_pod(node, name)), f"{name}'s pod on the node cache", 300)
        pod = cached["spec"]
        assert [v for v in pod["volumes"] if v["name"] == "ferry-weights" and "csi" in v], pod["volumes"]
        (vllm,) = [c for c in pod["containers"] if c["name"] == "vllm"]
        assert not [e for e in vllm.get("env") or [] if e["name"].startswith("AWS_")], vllm["env"]
        for c in pod["initContainers"]:  # the loader and the harvest
            refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env") or []
                    if "secretKeyRef" in e.get("valueFrom", {})}
            assert refs == {f"{name}-s3"}, (c["name"], refs)
        assert logs(node, cached, "vllm").startswith("COLD")
        assert "compiled state published" in harvested(node, cached)
        again = restart(node, name)
        assert logs(node, again, "vllm").strip() == f"WARM compiled-by-{cached['metadata']['name']}"
        assert "compiled state restored" in loader_message(again)
        assert "compiled state present" in harvested(node, again)
    finally:  # its pods mount a node cache entry: they go while the agent runs
        node.kubectl("delete", "deployment", name, "-n", NAMESPACE, "--wait=true", "--timeout=90s", check=False,
                     timeout=120)

    node.kubectl("delete", "modelweights", name, "-n", NAMESPACE, "--wait=false")
    wait_for(lambda: not stored(), "the compiled prefix emptied by the deletion", 180)
