"""serving.compiledState on the operator's side, without a cluster: the pod template pieces (vLLM's cache
root, the loader's restore, the harvest sidecar), their removal, the key and what changes it, and the
status. Shares nothing: hand-made facts and the planner (tests/worker/test_compiled_state.py covers the
worker's harvest and restore; tests/node/test_compiled_on_node.py runs both in pods on the real node)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ferry_operator.api.types import Artifact
from ferry_operator.api.validation import parse
from ferry_operator.planner import ArtifactFacts, Observed, StepPhase, StepState, plan
from ferry_operator.serving.compiled import (CACHE_PATH, HARVEST_CONTAINER, STORE_VOLUME, plan_compiled,
                                             pod_outcome, s3_store_of, store_of)
from ferry_operator.serving.loader import LOADER_CONTAINER, LoaderSettings
from ferry_operator.serving.weights_loaded import PodFacts
from ferry_operator.serving.wiring import WorkloadFacts, template_patch
from ferry_operator.steps import prepare_steps
from spec_cases import manifest, with_

URI = "pvc://llama-weights/llama/0b7e/8bcdf0a3ee78/artifact"
ARTIFACT = Artifact(uri=URI, format="sharded_state", tensor_parallel_size=4, manifest_digest="sha256:" + "1" * 64)
LOADER = LoaderSettings(image="ferry.local/ferry:1")
NAME = "llama-70b-vllm"


def spec(mode="AfterFirstReady", **serving):
    obj = with_("serving.compiledState", {"mode": mode})
    obj["spec"]["serving"].update(serving)
    return parse(obj).spec


def deployment(args=("--model", "m"), image="vllm/vllm-openai:v0.32.0", **kw):
    return WorkloadFacts(name=NAME, containers={"vllm": list(args)}, template_annotations={}, rolled_out=True,
                         images={"vllm": image}, **kw)


def pod_spec(patch):
    return patch["spec"]["template"]["spec"]


def test_the_template_keeps_and_restores_compiled_state():
    patch = template_patch(spec(), "llama", ARTIFACT, "vllm", deployment(), LOADER)
    pod = pod_spec(patch)
    loader, harvest = pod["initContainers"]
    assert loader["name"] == LOADER_CONTAINER and harvest["name"] == HARVEST_CONTAINER
    key = loader["args"][loader["args"].index("--compiled-key") + 1]
    assert loader["args"][-6:] == ["--compiled-store", "/ferry/compiled-store/compiled", "--compiled-key", key,
                                   "--compiled-to", CACHE_PATH]
    assert harvest["restartPolicy"] == "Always" and harvest["image"] == LOADER.image
    assert harvest["args"][harvest["args"].index("--health-url") + 1] == "http://127.0.0.1:8000/health"
    # The store is this object's own directory on its claim; only the sidecar may write it. The claim is the
    # weights' volume already (a pod may not list one claim twice): it turns writable, every other mount of it
    # stays read-only.
    (claim,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert claim["name"] == "ferry-weights" and claim["persistentVolumeClaim"] == {"claimName": "llama-weights",
                                                                                  "readOnly": False}
    store = [m for m in harvest["volumeMounts"] if m["mountPath"] == "/ferry/compiled-store"]
    assert store == [{"name": "ferry-weights", "mountPath": "/ferry/compiled-store", "subPath": "llama/0b7e"}]
    assert all(m.get("readOnly") for m in loader["volumeMounts"] if m["name"] == "ferry-weights")
    (vllm,) = pod["containers"]
    assert {"name": "VLLM_CACHE_ROOT", "value": CACHE_PATH} in vllm["env"]
    assert [m for m in vllm["volumeMounts"] if m["name"] == "ferry-weights"] == [
        {"name": "ferry-weights", "mountPath": "/ferry/weights", "readOnly": True, "subPath": "llama/0b7e/8bcdf0a3ee78/artifact"}]


def test_under_the_node_cache_the_store_is_a_volume_of_its_own():
    patch = template_patch(spec(nodeCache={"enabled": True}), "llama", ARTIFACT, "vllm", deployment(), LOADER)
    pod = pod_spec(patch)
    (store,) = [v for v in pod["volumes"] if v["name"] == STORE_VOLUME]
    assert store == {"name": STORE_VOLUME, "persistentVolumeClaim": {"claimName": "llama-weights"}}
    assert [v for v in pod["volumes"] if v["name"] == "ferry-weights"][0]["csi"]["readOnly"] is True


def wired(patch, base):
    """The Deployment as the patch leaves it (the fields template_patch reads)."""
    pod = pod_spec(patch)
    inits = {c["name"]: {"image": c.get("image"), "args": c.get("args", [])} for c in pod.get("initContainers", [])
             if "$patch" not in c}
    (vllm,) = pod["containers"]
    envs = {c["name"]: [e for e in c.get("env", []) if "$patch" not in e]
            for c in [vllm, *pod.get("initContainers", [])] if "$patch" not in c}
    return replace(base, containers={"vllm": vllm["args"]}, init_containers=inits, envs=envs,
                   readiness_gates=[g["conditionType"] for g in pod.get("readinessGates", [])],
                   probed=frozenset({"vllm"}),
                   template_annotations=patch["spec"]["template"]["metadata"]["annotations"],
                   weights_volume="persistentVolumeClaim")


def test_wiring_is_idempotent_and_every_key_input_changes_the_key():
    base = deployment()
    first = template_patch(spec(), "llama", ARTIFACT, "vllm", base, LOADER)
    current = wired(first, base)
    assert template_patch(spec(), "llama", ARTIFACT, "vllm", current, LOADER) is None

    def key(patch):
        args = pod_spec(patch)["initContainers"][0]["args"]
        return args[args.index("--compiled-key") + 1]
    other_image = template_patch(spec(), "llama", ARTIFACT, "vllm", replace(current, images={"vllm": "vllm:2"}),
                                 LOADER)
    other_flag = template_patch(spec(), "llama", ARTIFACT, "vllm",
                                replace(current, containers={"vllm": current.containers["vllm"] + ["--seed", "1"]}),
                                LOADER)
    other_weights = template_patch(spec(), "llama", ARTIFACT.model_copy(update={"manifest_digest": "sha256:" + "2" * 64}),
                                   "vllm", current, LOADER)
    keys = {key(first), key(other_image), key(other_flag), key(other_weights)}
    assert len(keys) == 4


def test_turned_off_every_piece_goes():
    base = deployment()
    current = wired(template_patch(spec(), "llama", ARTIFACT, "vllm", base, LOADER), base)
    patch = template_patch(spec("Off"), "llama", ARTIFACT, "vllm", current, LOADER)
    pod = pod_spec(patch)
    assert {"name": HARVEST_CONTAINER, "$patch": "delete"} in pod["initContainers"]
    assert "--compiled-key" not in pod["initContainers"][0]["args"]
    assert {"name": STORE_VOLUME, "$patch": "delete"} in pod["volumes"]
    (vllm,) = pod["containers"]
    assert {"name": "VLLM_CACHE_ROOT", "$patch": "delete"} in vllm["env"]
    assert {"mountPath": CACHE_PATH, "$patch": "delete"} in vllm["volumeMounts"]


@pytest.mark.parametrize("args, words", [
    (["--model", "m", "--enforce-eager"], "--enforce-eager"),
    (["--model", "m", "-O0"], "-O0"),
])
def test_a_pod_that_compiles_nothing_gets_nothing_and_the_reason(args, words):
    patch = template_patch(spec(), "llama", ARTIFACT, "vllm", deployment(args), LOADER)
    pod = pod_spec(patch)
    assert [c["name"] for c in pod["initContainers"]] == [LOADER_CONTAINER]
    compiled = plan_compiled(spec(), ARTIFACT, "img", args, True)
    assert not compiled.on and words in compiled.reason


def test_the_harvest_asks_vllm_where_and_how_it_serves():
    """The harvest waits for /health on the scheme and port the readiness probe uses: https under
    --ssl-keyfile. vLLM bound to one address (--host) does not answer on 127.0.0.1, so compiled state is off
    there, and the reason names the flag."""
    def harvest_url(args):
        patch = template_patch(spec(), "llama", ARTIFACT, "vllm", deployment(args), LOADER)
        harvest = [c for c in pod_spec(patch)["initContainers"] if c["name"] == HARVEST_CONTAINER]
        return harvest[0]["args"][harvest[0]["args"].index("--health-url") + 1] if harvest else None

    tls = ["--model", "m", "--port", "8443", "--ssl-keyfile", "/tls/key", "--ssl-certfile", "/tls/crt"]
    assert harvest_url(tls) == "https://127.0.0.1:8443/health"
    for everywhere in ("0.0.0.0", "::", "127.0.0.1"):
        assert harvest_url(["--model", "m", "--host", everywhere]) == "http://127.0.0.1:8000/health"
    assert harvest_url(["--model", "m", "--host", "$(POD_IP)"]) is None
    assert harvest_url(["--model", "m", "--host", "0.0.0.0", "--host", "10.0.0.7"]) is None  # argparse's last
    compiled = plan_compiled(spec(), ARTIFACT, "i", ["--model", "m", "--host=10.0.0.7"], True)
    assert not compiled.on and "--host 10.0.0.7" in compiled.reason


def test_where_it_does_not_apply_says_why():
    assert "Off" in plan_compiled(spec("Off"), ARTIFACT, "i", [], True).reason
    assert "readinessGate" in plan_compiled(spec(), ARTIFACT, "i", [], False).reason
    s3 = ARTIFACT.model_copy(update={"uri": "s3://bucket/llama/x"})
    assert "claim" in plan_compiled(spec(), s3, "i", [], True).reason
    assert store_of(URI) == ("llama-weights", "llama/0b7e")
    for odd in ("pvc://c", "pvc://c/artifact", "pvc://c//x/artifact", "pvc://c/a/b/staging", "file:///a/b/artifact"):
        assert store_of(odd) is None


def test_the_loaders_words_are_parsed_and_nothing_else():
    assert pod_outcome("verified (sha256): 3 files; compiled state restored: 12 files, 9 bytes from k/d, "
                       "verified") == ("restored", "12 files, 9 bytes from k/d, verified")
    assert pod_outcome("verified (sha256): 3 files") is None
    assert pod_outcome("compiled state exploded: x") is None


# --- the status ----------------------------------------------------------------------------------------------

FACTS = ArtifactFacts(uri=URI, total_bytes=3 << 30, manifest_digest=ARTIFACT.manifest_digest)


def status_after(m, current, pods):
    steps = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}
    return plan(m, Observed(steps=steps, artifact=FACTS, workloads={NAME: current}, pods=pods), loader=LOADER)


def mw(mode="AfterFirstReady", status=None):
    obj = with_("serving.compiledState", {"mode": mode})
    obj["metadata"]["uid"] = "0b7e"
    if status:
        obj["status"] = status
    return parse(obj)


def pod(name, message):
    return PodFacts(name=name, owner="llama", digest=FACTS.manifest_digest, gate="True", reason="Loaded",
                    message=message, workload=NAME)


def wired_with(spec_, base):
    return wired(template_patch(spec_, "llama", ARTIFACT, "vllm", base, LOADER), base)


def test_the_status_counts_warm_pods_and_names_a_key_change():
    m = mw()
    unwired = status_after(m, deployment(), []).status.compiled_state
    assert not unwired.key and "being wired" in unwired.message
    current = wired_with(m.spec, deployment())
    p0 = status_after(m, current, [])
    first = p0.status.compiled_state
    assert first.key and first.inputs["image"] == "vllm/vllm-openai:v0.32.0"
    assert "new key" not in first.message  # turning it on is no change of key
    pods = [pod("a", "ok; compiled state restored: 3 files, 10 bytes from x, verified"),
            pod("b", "ok; compiled state absent: none for this configuration yet")]
    status = status_after(m, current, pods).status.compiled_state
    assert status.restored_replicas == 1 and status.message.startswith("pod b: absent")
    before = json.loads(p0.status.model_dump_json(by_alias=True, exclude_none=True))
    # The user's new image: until Ferry rewired the template the status stays; then it names the change.
    moved = replace(current, images={"vllm": "vllm:2"})
    assert status_after(mw(status=before), moved, []).status.compiled_state.key == first.key
    rewired = wired_with(m.spec, moved)
    changed = status_after(mw(status=before), rewired, []).status.compiled_state
    assert changed.key != first.key and "image changed" in changed.message
    env = replace(rewired, envs={"vllm": [{"name": "VLLM_USE_V1", "value": "1"}]})
    assert wired_with(m.spec, env).init_containers != rewired.init_containers  # the user's env is in the key
    assert status_after(mw("Off"), current, pods).status.compiled_state is None


def test_the_status_names_a_tag_that_moved_between_pods():
    """The key holds the image reference: pods that pulled one tag as different bytes (the kubelet's
    imageID) share an entry vLLM's own key tells apart; the status says so and how to key by the bytes."""
    m = mw()
    current = wired_with(m.spec, deployment())
    old, new = "docker.io/vllm/vllm-openai@sha256:" + "a" * 64, "docker.io/vllm/vllm-openai@sha256:" + "b" * 64

    def running(name, image_id, image="vllm/vllm-openai:v0.32.0",
                message="ok; compiled state restored: 3 files, 10 bytes from x, verified"):
        return replace(pod(name, message), images=(("vllm", image),),
                       image_ids=(("ferry-compiled-harvest", "sha256:" + "c" * 64), ("vllm", image_id)))
    moved = status_after(m, current, [running("a", old), running("b", new)]).status.compiled_state
    assert "the tag moved" in moved.message and "aaaaaaaaaaaa, bbbbbbbbbbbb" in moved.message, moved.message
    assert "vllm/vllm-openai:v0.32.0@sha256:" in moved.message and moved.message.startswith("pod a: restored")
    # A "new key" message kept from before keeps one copy of these words, not one more per pass.
    kept = {"compiledState": {"key": moved.key, "inputs": moved.inputs, "message": f"new key: image changed, so "
                              f"pods compile afresh until one keeps the new state; {moved.message}"}}
    again = status_after(mw(status=kept), current, [running("a", old, message="ok; compiled state absent: x"),
                                                    running("b", new, message="ok; compiled state absent: x")])
    assert again.status.compiled_state.message.count("the pods run") == 1, again.status.compiled_state.message
    same = status_after(m, current, [running("a", old), running("b", old)]).status.compiled_state
    assert "tag moved" not in same.message
    # A bare config id (an image loaded onto a node) is compared with config ids only: a repository digest
    # names the same bytes another way. A pod of the template before (another image, a rollout under way)
    # and a forged imageID do not count.
    spelled = status_after(m, current, [running("a", old), running("b", "sha256:" + "b" * 64)]).status
    assert "tag moved" not in spelled.compiled_state.message
    loaded = [running("a", "sha256:" + "d" * 64), running("b", "sha256:" + "e" * 64), running("c", new)]
    reloaded = status_after(m, current, loaded).status.compiled_state.message
    assert "as 2 different images (dddddddddddd, eeeeeeeeeeee)" in reloaded, reloaded
    twice = [running("a", "sha256:" + "d" * 64), running("b", "sha256:" + "d" * 64), running("c", new)]
    assert "tag moved" not in status_after(m, current, twice).status.compiled_state.message
    rolling = [running("a", old), running("b", new, image="vllm/vllm-openai:v0.31.0")]
    assert "tag moved" not in status_after(m, current, rolling).status.compiled_state.message
    forged = [running("a", old), running("b", "sha256:\nnot-a-digest")]
    assert "tag moved" not in status_after(m, current, forged).status.compiled_state.message
    pinned = wired_with(m.spec, deployment(image="vllm/vllm-openai@sha256:" + "a" * 64))
    by_digest = status_after(m, pinned, [running("a", old), running("b", new)]).status.compiled_state
    assert "tag moved" not in by_digest.message  # a reference by digest is its bytes


def test_a_read_only_many_claim_gets_no_compiled_state():
    s = parse(with_("storage.pvc.accessModes", ["ReadOnlyMany"], with_("serving.compiledState",
                                                                      {"mode": "AfterFirstReady"}))).spec
    compiled = plan_compiled(s, ARTIFACT, "i", [], True)
    assert not compiled.on and "ReadOnlyMany" in compiled.reason


def test_turning_the_node_cache_off_drops_the_store_volume_of_its_own():
    base = deployment()
    cached = wired(template_patch(spec(nodeCache={"enabled": True}), "llama", ARTIFACT, "vllm", base, LOADER), base)
    patch = template_patch(spec(), "llama", ARTIFACT, "vllm", replace(cached, weights_volume="csi"), LOADER)
    assert {"name": STORE_VOLUME, "$patch": "delete"} in pod_spec(patch)["volumes"]


def test_each_pods_start_is_observed_once_by_its_compiled_outcome():
    from ferry_operator import metrics
    from ferry_operator.serving.weights_loaded import pod_facts

    def count(label):
        return metrics.POD_START_SECONDS.labels(label)._sum.get(), sum(
            b.get() for b in metrics.POD_START_SECONDS.labels(label)._buckets)
    body = {"metadata": {"name": "p", "uid": "u-1", "creationTimestamp": "2026-12-04T10:00:00Z",
                         "annotations": {"ferry.dev/modelweights": "llama"}},
            "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-04T10:00:52Z"},
                                      {"type": "ferry.dev/weights-loaded", "status": "True",
                                       "message": "ok; compiled state restored: 3 files, 9 bytes from k/d, verified"}]}}
    facts = pod_facts(body)
    assert facts.ready_seconds == 52.0
    before = count("restored")
    metrics.pod_started(facts.uid, facts.ready_seconds, "restored")
    metrics.pod_started(facts.uid, facts.ready_seconds, "restored")  # the same pod again: not counted
    after = count("restored")
    assert after[0] - before[0] == 52.0 and after[1] - before[1] == 1
    metrics.pod_started("u-2", 80.0, "something a pod wrote")
    assert count("off")[0] >= 80.0  # an unknown outcome is never a new label
    not_ready = {**body, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    assert pod_facts(not_ready).ready_seconds is None


# --- the store in S3, beside an artifact Ferry published there ------------------------------------------------

S3_STORAGE = {"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://ferry-artifacts/llama", "endpoint": "http://minio:9000",
                                            "credentialsSecretRef": {"name": "s3-creds"}}}
S3_ARTIFACT = Artifact(uri="s3://ferry-artifacts/llama/ml/llama/0b7e/abc123", format="runai_streamer",
                       manifest_digest="sha256:" + "4" * 64)


def s3_spec(**serving):
    obj = with_("serving.compiledState", {"mode": "AfterFirstReady"},
                manifest(format={"type": "runai_streamer"}, storage=S3_STORAGE))
    obj["spec"]["serving"].update(serving)
    return parse(obj).spec


def test_an_s3_artifacts_compiled_state_is_kept_in_s3_beside_it():
    patch = template_patch(s3_spec(), "llama", S3_ARTIFACT, "vllm", deployment(), LOADER)
    pod = pod_spec(patch)
    loader, harvest = pod["initContainers"]
    store = "s3://ferry-artifacts/llama/ml/llama/0b7e/compiled"
    assert loader["args"][loader["args"].index("--compiled-store") + 1] == store
    assert harvest["args"][harvest["args"].index("--store") + 1] == store
    # The credentials by named key (never envFrom), the tar packed in a capped scratch emptyDir, no claim.
    env = {e["name"]: e for e in harvest["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY", "optional": False}
    assert env["TMPDIR"]["value"] == "/ferry/compiled-scratch" and "envFrom" not in harvest
    assert {"name": "ferry-compiled-scratch", "emptyDir": {"sizeLimit": "17Gi"}} in pod["volumes"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v or v["name"] == STORE_VOLUME]
    assert "$patch" not in json.dumps(harvest)  # no directive inside a container the patch adds
    # Ferry's own S3 env, which the wiring adds to the vLLM container, is not in the key: no second rollout.
    wired_s3 = replace(wired(patch, deployment()), weights_volume="")
    assert template_patch(s3_spec(), "llama", S3_ARTIFACT, "vllm", wired_s3, LOADER) is None


def test_a_changed_s3_secret_reaches_every_container_that_reads_the_store():
    """storage.s3.credentialsSecretRef is not in the key (the same bytes), but the vLLM container, the
    loader and the harvest read S3 with it: the template is rewired, each of the three gets the new name."""
    patch = template_patch(s3_spec(), "llama", S3_ARTIFACT, "vllm", deployment(), LOADER)
    current = replace(wired(patch, deployment()), weights_volume="")
    moved = parse(with_("storage.s3.credentialsSecretRef", {"name": "s3-creds-2"}, with_(
        "serving.compiledState", {"mode": "AfterFirstReady"},
        manifest(format={"type": "runai_streamer"}, storage=S3_STORAGE)))).spec
    again = template_patch(moved, "llama", S3_ARTIFACT, "vllm", current, LOADER)
    assert again is not None
    pod = pod_spec(again)
    loader, harvest = pod["initContainers"]
    for container in (pod["containers"][0], loader, harvest):
        secrets = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        assert secrets == {"s3-creds-2"}, container["name"]
    assert loader["args"] == pod_spec(patch)["initContainers"][0]["args"]  # the same key: only the env moved
    assert template_patch(moved, "llama", S3_ARTIFACT, "vllm", replace(wired(again, deployment()), weights_volume=""),
                          LOADER) is None


def test_under_the_node_cache_the_state_is_in_s3_and_only_ferrys_containers_hold_credentials():
    """Weights from the node cache: vLLM reads no S3 and holds no S3 credentials; the loader (restore) and
    the harvest (publish) hold them for the compiled state's store in S3, by named keys. A moved Secret
    reaches both, and the rewired template is at rest."""
    cached = s3_spec(nodeCache={"enabled": True})
    patch = template_patch(cached, "llama", S3_ARTIFACT, "vllm", deployment(), LOADER)
    pod = pod_spec(patch)
    (vllm,), (loader, harvest) = pod["containers"], pod["initContainers"]
    assert not [e for e in vllm.get("env", []) if e["name"].startswith("AWS_") and "$patch" not in e]
    assert [v for v in pod["volumes"] if v["name"] == "ferry-weights"][0]["csi"]["readOnly"] is True
    store = "s3://ferry-artifacts/llama/ml/llama/0b7e/compiled"
    assert loader["args"][loader["args"].index("--compiled-store") + 1] == store
    for c in (loader, harvest):
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
        assert refs == {"s3-creds"} and not [e for e in c["env"] if "$patch" in e], c["name"]
    preferred = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    current = replace(wired(patch, deployment()), weights_volume="csi", preferred_nodes=preferred)
    assert template_patch(cached, "llama", S3_ARTIFACT, "vllm", current, LOADER) is None
    moved = parse(with_("storage.s3.credentialsSecretRef", {"name": "s3-creds-2"}, with_(
        "serving.nodeCache", {"enabled": True}, with_("serving.compiledState", {"mode": "AfterFirstReady"},
                                                      manifest(format={"type": "runai_streamer"}, storage=S3_STORAGE))))).spec
    again = pod_spec(template_patch(moved, "llama", S3_ARTIFACT, "vllm", current, LOADER))
    assert {e["valueFrom"]["secretKeyRef"]["name"] for e in again["initContainers"][0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})} == {"s3-creds-2"}


def test_an_s3_artifact_ferry_did_not_publish_gets_no_compiled_state():
    users = S3_ARTIFACT.model_copy(update={"uri": "s3://someone-elses/models/llama"})  # not Ferry's prefix
    foreign = plan_compiled(s3_spec(), users, "i", [], True)
    assert not foreign.on and "published to storage.s3" in foreign.reason
    assert s3_store_of(s3_spec(), "s3://ferry-artifacts/llama/ml/llama/0b7e/abc123") == \
        "s3://ferry-artifacts/llama/ml/llama/0b7e/compiled"
    for odd in ("s3://ferry-artifacts/llama/ml/llama/abc", "s3://ferry-artifacts/llama/ml/llama/../x/abc",
                "s3://ferry-artifacts/llamaX/ml/llama/0b7e/abc", "s3://ferry-artifacts/llama/ml//0b7e/abc"):
        assert s3_store_of(s3_spec(), odd) is None, odd


def test_deleting_the_object_deletes_its_compiled_state_beside_its_s3_artifacts():
    """deletionPolicy Delete: a Job per S3 artifact, and one for the compiled prefix (kept or not: the setting
    may have been turned off since)."""
    from ferry_operator.executors import jobs
    from ferry_operator.executors.kubernetes import KubernetesExecutor

    obj = manifest(format={"type": "runai_streamer"}, storage=S3_STORAGE)
    obj["metadata"].update(namespace="ml", uid="0b7e")
    digest = prepare_steps(parse(obj).spec)[0].digest
    uri = f"s3://ferry-artifacts/llama/ml/llama/0b7e/{digest}"
    obj["status"] = {"artifact": {"uri": uri, "format": "runai_streamer", "specDigest": digest,
                                  "manifestDigest": "sha256:" + "4" * 64}}
    m = parse(obj)
    made = []
    ex = KubernetesExecutor(jobs.WorkerSettings(image=LOADER.image))
    ex.batch.create_namespaced_job = lambda namespace, body: made.append(body)
    ex.delete(m)
    args = [job["spec"]["template"]["spec"]["containers"][0]["args"] for job in made]
    assert args == [["delete-artifact", uri],
                    ["compiled-delete", "--store", "s3://ferry-artifacts/llama/ml/llama/0b7e/compiled"]]
