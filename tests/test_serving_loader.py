"""The loader wiring and the WeightsLoaded aggregation, without a cluster."""
from __future__ import annotations

import json
from dataclasses import replace

from ferry_operator.api.validation import parse
from ferry_operator.planner import ArtifactFacts, Observed, PatchWorkload, StepPhase, StepState, plan
from ferry_operator.serving.wiring import WorkloadFacts, deployment_facts
from ferry_operator.serving.loader import GATE, LOADER_CONTAINER, TOKEN_VOLUME, LoaderSettings, health_probe
from ferry_operator.steps import prepare_steps
from ferry_operator.serving.weights_loaded import PodFacts, pod_facts, summarize
from spec_cases import manifest
from serving_cases import merged_weights_volume

LOADER = LoaderSettings(image="ferry.local/ferry:dev", resources={"requests": {"cpu": "1"}})
DIGEST = "sha256:" + "0" * 64
FACTS = ArtifactFacts(uri="pvc://llama-weights/llama/abc", total_bytes=3 << 30, manifest_digest=DIGEST)
NAME = "llama-70b-vllm"


def mw(**spec):
    obj = manifest()
    obj["spec"].update(spec)
    return parse({**obj, "metadata": {**obj["metadata"], "generation": 2}})


def observed(m, dep: WorkloadFacts, pods=()) -> Observed:
    return Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}, artifact=FACTS,
                    workloads={NAME: dep}, pods=list(pods))


def conds(p):
    return {c.type: (c.status, c.reason, c.message) for c in p.status.conditions}


def deployment(**kw) -> WorkloadFacts:
    base = WorkloadFacts(name=NAME, containers={"vllm": ["--model", "meta-llama/Meta-Llama-3-70B-Instruct",
                                                            "--port", "8080"]},
                           template_annotations={}, rolled_out=True, readiness_gates=["example.com/lb-ready"],
                           service_account="serving", replicas=2)
    return replace(base, **kw)


def applied(current: WorkloadFacts, patch: dict) -> WorkloadFacts:
    """The fields Ferry reads, after the API server's strategic merge of `patch`."""
    pod = patch["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    inits = dict(current.init_containers)
    for i in pod.get("initContainers", []):
        if i.get("$patch") == "delete":
            inits.pop(i["name"], None)
        else:
            inits[i["name"]] = {"image": i["image"], "args": i["args"]}
    gates = [g["conditionType"] for g in pod["readinessGates"]] if "readinessGates" in pod else current.readiness_gates
    annotations = {k: v for k, v in {**current.template_annotations,
                                     **patch["spec"]["template"]["metadata"]["annotations"]}.items() if v is not None}
    return replace(current, containers={**current.containers, c["name"]: c["args"]}, init_containers=inits,
                   readiness_gates=gates, template_annotations=annotations,
                   probed=current.probed | ({c["name"]} if "readinessProbe" in c else set()),
                   weights_volume=merged_weights_volume(current, pod))


def test_the_gate_wires_the_loader_the_gate_the_token_and_a_health_probe():
    m = mw()
    p = plan(m, observed(m, deployment()), loader=LOADER)
    (action,) = p.actions
    assert isinstance(action, PatchWorkload) and action.reporter_service_account == "serving"
    pod = action.patch["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["name"] == LOADER_CONTAINER and init["image"] == LOADER.image and init["command"] == ["ferry"]
    assert init["args"] == ["load", "--artifact", "/ferry/weights", "--expected-digest", DIGEST]
    assert init["resources"] == {"requests": {"cpu": "1"}}
    mounts = {v["name"]: v for v in init["volumeMounts"]}
    assert mounts["ferry-weights"]["readOnly"] and mounts["ferry-weights"]["subPath"] == "llama/abc"
    assert mounts[TOKEN_VOLUME]["mountPath"] == "/var/run/secrets/ferry.dev/serviceaccount"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in init["env"]
    # The user's own gate is kept (the list is replaced whole by a strategic merge).
    assert pod["readinessGates"] == [{"conditionType": "example.com/lb-ready"}, {"conditionType": GATE}]
    token = next(v for v in pod["volumes"] if v["name"] == TOKEN_VOLUME)
    assert token["projected"]["sources"][0]["serviceAccountToken"]["expirationSeconds"] == 3600
    # vLLM's /health on the port its command line serves.
    assert pod["containers"][0]["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8080, "scheme": "HTTP"}


def test_wiring_is_idempotent_and_ready_waits_for_every_replica_to_load():
    m = mw()
    current = deployment()
    first = plan(m, observed(m, current), loader=LOADER)
    wired = applied(current, first.actions[0].patch)
    pods = [PodFacts(name="p-a", owner="llama", digest=DIGEST, gate="True", reason="Loaded", load_seconds=4.0),
            PodFacts(name="p-b", owner="llama", digest=DIGEST, gate="False", reason="Loading")]
    p = plan(m, observed(m, wired, pods), loader=LOADER)
    assert p.actions == []
    assert conds(p)["WeightsLoaded"] == ("False", "Loading", "1/2 replicas loaded (p50 4s)")
    assert conds(p)["Ready"][:2] == ("False", "WeightsLoading")
    assert p.status.loaded.summary == "1/2" and p.status.loaded.p50_load_seconds == 4.0
    done = [pods[0], replace(pods[1], gate="True", reason="Loaded", load_seconds=6.0),
            # An old ReplicaSet's pod (another digest) and a terminating one do not count.
            PodFacts(name="p-old", owner="llama", digest="sha256:" + "9" * 64, gate="False", reason="VerificationFailed"),
            PodFacts(name="p-gone", owner="llama", digest=DIGEST, gate="False", reason="LoadFailed", terminating=True)]
    p = plan(m, observed(m, wired, done), loader=LOADER)
    assert conds(p)["WeightsLoaded"][:2] == ("True", "Loaded") and conds(p)["Ready"][:2] == ("True", "Ready")
    assert p.status.loaded.p50_load_seconds == 5.0 and "loaded by 2/2 replicas" in conds(p)["Ready"][2]


def test_a_corrupt_file_reported_by_a_pod_stalls_naming_pod_and_file():
    m = mw()
    current = deployment()
    wired = applied(current, plan(m, observed(m, current), loader=LOADER).actions[0].patch)
    bad = PodFacts(name="p-b", owner="llama", digest=DIGEST, gate="False", reason="VerificationFailed",
                   message="model-rank-3-part-0.safetensors: sha256 ab != cd in manifest")
    p = plan(m, observed(m, wired, [bad]), loader=LOADER)
    status, reason, message = conds(p)["WeightsLoaded"]
    assert (status, reason) == ("False", "VerificationFailed")
    assert "pod p-b" in message and "model-rank-3-part-0.safetensors" in message
    assert conds(p)["Stalled"][:2] == ("True", "WeightsVerificationFailed")
    assert conds(p)["Ready"][:2] == ("False", "WeightsLoadFailed")


def test_turning_the_gate_off_removes_the_loader_and_keeps_the_users_gates():
    m = mw()
    current = deployment()
    wired = applied(current, plan(m, observed(m, current), loader=LOADER).actions[0].patch)
    off = mw(serving={"deployments": [{"name": NAME, "container": "vllm"}], "readinessGate": False})
    (action,) = plan(off, observed(off, wired), loader=LOADER).actions
    pod = action.patch["spec"]["template"]["spec"]
    assert pod["initContainers"] == [{"name": LOADER_CONTAINER, "$patch": "delete"}]
    assert pod["readinessGates"] == [{"conditionType": "example.com/lb-ready"}]
    assert {"name": TOKEN_VOLUME, "$patch": "delete"} in pod["volumes"]
    unwired = applied(wired, action.patch)
    p = plan(off, observed(off, unwired), loader=LOADER)
    assert p.actions == [] and "WeightsLoaded" not in conds(p) and p.status.loaded is None


def test_streaming_from_the_source_has_no_manifest_so_no_gate():
    m = mw(source={"uri": "s3://models/qwen"}, storage=None, format={"type": "runai_streamer"})
    o = Observed(steps={}, artifact=None, workloads={NAME: deployment()})
    (action,) = plan(m, o, loader=LOADER).actions
    assert "initContainers" not in action.patch["spec"]["template"]["spec"] and action.reporter_service_account is None


def test_health_probe_follows_port_and_tls_in_a_script():
    assert health_probe(["sh", "-c", "exec vllm serve m --port=9000 --ssl-keyfile /k"])["httpGet"] == \
        {"path": "/health", "port": 9000, "scheme": "HTTPS"}
    assert health_probe(["vllm", "serve", "m"])["httpGet"]["port"] == 8000


def test_pod_facts_from_the_api_object():
    body = {"metadata": {"name": "p", "annotations": {"ferry.dev/modelweights": "llama",
                                                      "ferry.dev/artifact-digest": DIGEST}},
            "status": {"conditions": [{"type": GATE, "status": "True", "reason": "Loaded", "message": "ok"}],
                       "initContainerStatuses": [{"name": LOADER_CONTAINER, "state": {"terminated": {
                           "exitCode": 0, "startedAt": "2026-12-01T10:00:00Z", "finishedAt": "2026-12-01T10:00:07Z"}}}],
                       "containerStatuses": [{"name": "vllm", "imageID": "docker.io/v@sha256:" + "a" * 64},
                                             {"name": "sidecar"}]}}  # not started: no imageID yet
    facts = pod_facts(body)
    assert (facts.owner, facts.digest, facts.gate, facts.load_seconds) == ("llama", DIGEST, "True", 7.0)
    assert facts.image_ids == (("vllm", "docker.io/v@sha256:" + "a" * 64),)
    assert summarize([facts], DIGEST, 1).complete


def test_deployment_facts_read_what_the_wiring_compares():
    facts = deployment_facts({"metadata": {"name": NAME, "generation": 1}, "spec": {"replicas": 3, "template": {
        "spec": {"serviceAccountName": "serving", "readinessGates": [{"conditionType": GATE}],
                 "initContainers": [{"name": LOADER_CONTAINER, "image": "i", "args": ["load"]}],
                 "containers": [{"name": "vllm", "readinessProbe": {"httpGet": {"path": "/health"}}}]}}},
        "status": {}})
    assert facts.replicas == 3 and facts.service_account == "serving" and facts.probed == {"vllm"}
    assert facts.init_containers == {LOADER_CONTAINER: {"image": "i", "args": ["load"]}}
    assert facts.readiness_gates == [GATE]


def test_local_copy_serves_from_an_emptydir_the_loader_fills():
    m = mw(serving={"deployments": [{"name": NAME, "container": "vllm"}], "localCopy": True})
    (action,) = plan(m, observed(m, deployment()), loader=LOADER).actions
    pod = action.patch["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"][-2:] == ["--copy-to", "/ferry/local"]
    assert {"name": "ferry-local", "mountPath": "/ferry/local"} in init["volumeMounts"]
    local = next(v for v in pod["volumes"] if v["name"] == "ferry-local")
    assert int(local["emptyDir"]["sizeLimit"]) >= FACTS.total_bytes
    c = pod["containers"][0]
    assert c["args"][c["args"].index("--model") + 1] == "/ferry/local"
    assert {"name": "ferry-local", "mountPath": "/ferry/local", "readOnly": True} in c["volumeMounts"]


def test_local_copy_without_the_gate_is_rejected_naming_the_field():
    import pytest
    from ferry_operator.api.validation import InvalidSpec

    with pytest.raises(InvalidSpec, match="localCopy"):
        mw(serving={"deployments": [{"name": NAME}], "localCopy": True, "readinessGate": False})


def test_tensorizer_from_s3_is_wired_with_the_uri_readers_and_key_without_secrets_in_args():
    m = mw(format={"type": "tensorizer", "tensorParallelSize": 2,
                   "tensorizer": {"numReaders": 4, "encryptionSecretRef": {"name": "key"}}},
           storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x", "endpoint": "http://minio:9000",
                                                   "credentialsSecretRef": {"name": "store"}}})
    artifact = ArtifactFacts(uri="s3://bucket/x/ns/llama/abc", total_bytes=1, manifest_digest=DIGEST)
    o = Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}, artifact=artifact,
                 workloads={NAME: deployment()})
    (action,) = plan(m, o, loader=LOADER).actions
    pod = action.patch["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = c["args"]
    assert args[args.index("--model") + 1] == artifact.uri
    assert json.loads(args[args.index("--model-loader-extra-config") + 1]) == {
        "tensorizer_uri": "s3://bucket/x/ns/llama/abc/model-rank-%03d.tensors", "num_readers": 4,
        "encryption_keyfile": "/ferry/secrets/tensorizer/key"}
    assert {"name": "ferry-tensorizer-key", "mountPath": "/ferry/secrets/tensorizer", "readOnly": True} \
        in c["volumeMounts"]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "store"
    (init,) = pod["initContainers"]
    assert init["args"][:3] == ["load", "--artifact", artifact.uri]
    assert "AWS_ENDPOINT_URL" in {e["name"] for e in init["env"]}
