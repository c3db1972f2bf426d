"""Ferry's Deployment patches as the real API server merges them (strategic
merge: env and volumes by name, volumeMounts by mountPath), for the node
cache turned on and off under an S3 artifact: what an earlier wiring added
and the next one does not want is really gone, and no patch is refused
(an init container's mount of a deleted volume would be a 422). The facts
each patch is computed from are read back from the API server, as the
operator reads them."""
from __future__ import annotations

import json

import pytest

from ferry_operator.api.types import Artifact
from ferry_operator.api.validation import parse
from ferry_operator.serving import strategic
from ferry_operator.serving.wiring import Group, deployment_facts, template_facts, template_patch
from ferry_operator.serving.loader import LoaderSettings
from spec_cases import manifest, with_

pytestmark = pytest.mark.cluster

DIGEST = "sha256:" + "3" * 64
ARTIFACT = Artifact(uri="s3://ferry-artifacts/llama/abc", format="runai_streamer", total_bytes=1 << 20,
                    manifest_digest=DIGEST)
RUNAI_S3 = manifest(format={"type": "runai_streamer"}, storage={
    "pvc": {"size": "1Gi"}, "s3": {"uri": "s3://ferry-artifacts/llama", "endpoint": "http://minio.storage:9000",
                                   "credentialsSecretRef": {"name": "s3-creds"}}})


def spec(cache: bool):
    return parse(with_("serving.nodeCache", {"enabled": cache}, RUNAI_S3)).spec


def test_turning_the_node_cache_on_and_off_under_an_s3_artifact_merges_cleanly(kube, namespace):
    kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "vllm", "namespace": namespace},
                "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "vllm"}}, "template": {
                    "metadata": {"labels": {"app": "vllm"}},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                             "command": ["vllm", "serve"],
                                             "args": ["meta-llama/Meta-Llama-3-8B", "--max-model-len", "256"]}]}}}})

    def wire(cache: bool) -> dict:
        current = deployment_facts(kube.get_json("deployment", "vllm", "-n", namespace))
        patch = template_patch(spec(cache), "llama", ARTIFACT, "vllm", current,
                                 LoaderSettings(image="ferry.local/ferry:dev"))
        assert patch is not None
        kube.kubectl("patch", "deployment", "vllm", "-n", namespace, "--type=strategic", "-p", json.dumps(patch))
        return kube.get_json("deployment", "vllm", "-n", namespace)["spec"]["template"]["spec"]

    def aws(container: dict) -> list[str]:
        return [e["name"] for e in container.get("env") or [] if e["name"].startswith("AWS_")]

    streamed = wire(False)
    (vllm,), (init,) = streamed["containers"], streamed["initContainers"]
    assert "AWS_ACCESS_KEY_ID" in aws(vllm) and "AWS_ACCESS_KEY_ID" in aws(init)
    assert not [v for v in streamed.get("volumes") or [] if v["name"] == "ferry-weights"]

    cached = wire(True)
    (vllm,), (init,) = cached["containers"], cached["initContainers"]
    assert aws(vllm) == [] and aws(init) == []  # the pods read no S3, and hold no S3 credentials
    (volume,) = [v for v in cached["volumes"] if v["name"] == "ferry-weights"]
    assert volume == {"name": "ferry-weights", "csi": {"driver": "cache.ferry.dev", "readOnly": True,
                                                       "volumeAttributes": {"digest": DIGEST}}}
    assert "/ferry/weights" in [m["mountPath"] for m in init["volumeMounts"]]
    assert "/ferry/weights" in vllm["args"] + vllm.get("command", [])

    again = wire(False)
    (vllm,), (init,) = again["containers"], again["initContainers"]
    assert not [v for v in again["volumes"] if v["name"] == "ferry-weights"]
    assert "/ferry/weights" not in [m["mountPath"] for m in init["volumeMounts"] + (vllm.get("volumeMounts") or [])]
    assert "AWS_ACCESS_KEY_ID" in aws(vllm) and any(a.startswith("s3://") for a in vllm["args"])


def _normalized(template: dict) -> dict:
    """The template with every list strategic merge keys sorted by its key: the API server's merge may
    order new elements differently, which changes nothing a pod does."""
    def walk(value, key=None):
        if isinstance(value, dict):
            return {k: walk(v, k) for k, v in value.items()}
        if isinstance(value, list):
            items = [walk(v) for v in value]
            if key in strategic.MERGE_KEYS:
                items.sort(key=lambda item: str(item.get(strategic.MERGE_KEYS[key])))
            return items
        return value
    return walk(template)


def test_the_local_strategic_merge_equals_the_api_servers(kube, namespace):
    """A LeaderWorkerSet's templates get Ferry's patches merged locally (strategic.py). The same sequence of
    patches (the node cache's on/off swap under S3, then a group's wiring with its env, flags and loader
    arguments), applied by the real API server to a Deployment's template and locally to the template it had
    before each, gives the same template once both go through the API server's defaulting."""
    start = {"metadata": {"labels": {"app": "vllm"}},
             "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "command": ["vllm", "serve"],
                                      "args": ["meta-llama/Meta-Llama-3-8B", "--headless"],
                                      "env": [{"name": "KEEP", "value": "1"}]}]}}

    def deployment(name: str, template: dict) -> dict:
        return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "vllm"}}, "template": template}}

    def defaulted(template: dict) -> dict:
        out = kube.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                           input=json.dumps(deployment("dry", template))).stdout
        return _normalized(json.loads(out)["spec"]["template"])

    kube.apply(deployment("vllm", start))
    group = Group(2, "leaderworkerset.sigs.k8s.io/worker-index", "$(LWS_LEADER_ADDRESS)", headless=True)
    for cache, grouped in ((False, None), (True, None), (False, group), (True, group)):
        before = kube.get_json("deployment", "vllm", "-n", namespace)["spec"]["template"]
        patch = template_patch(spec(cache), "llama", ARTIFACT, "vllm", template_facts("vllm", before),
                               LoaderSettings(image="ferry.local/ferry:dev"), grouped)
        assert patch is not None
        kube.kubectl("patch", "deployment", "vllm", "-n", namespace, "--type=strategic", "-p", json.dumps(patch))
        server = kube.get_json("deployment", "vllm", "-n", namespace)["spec"]["template"]
        local = strategic.apply(before, patch["spec"]["template"])
        assert defaulted(local) == _normalized(server), (cache, grouped)


@pytest.mark.parametrize("own", [
    {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": "50%", "maxUnavailable": 0}},
    {"type": "Recreate"},
])
def test_a_rollout_in_place_and_the_strategy_put_back_merge_as_planned(kube, namespace, own):
    """serving.rollout InPlace: the template and the strategy in one patch, then the Deployment's own strategy
    back (a Recreate too, whose rollingUpdate must go). The facts are read back as the operator reads them."""
    from ferry_operator.serving.rollout import IN_PLACE, put_back, rollout_patch, with_strategy
    name = "roll-" + own["type"].lower()
    kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": 0, "strategy": own, "selector": {"matchLabels": {"app": name}}, "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                             "args": ["--model", "m"]}]}}}})
    current = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
    patch = template_patch(spec(False), "llama", ARTIFACT, "vllm", current, LoaderSettings(image="ferry.local/f:1"))
    surging = own["type"] == "RollingUpdate"
    roll = rollout_patch("InPlace", "Deployment", name, current.strategy, current.saved_strategy, True, False)
    assert (roll is not None) == surging
    if not surging:  # Ferry leaves a Recreate alone; a saved one (written by hand) is put back all the same
        kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=strategic", "-p",
                     json.dumps({"spec": {"strategy": IN_PLACE},
                                 "metadata": {"annotations": {"ferry.dev/rollout-strategy": json.dumps(own)}}}))
    kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=strategic", "-p",
                 json.dumps(with_strategy(patch, roll)))
    rolled = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
    assert rolled.strategy == IN_PLACE and json.loads(rolled.saved_strategy)["type"] == own["type"]
    assert rolled.template_annotations["ferry.dev/artifact-digest"] == DIGEST
    back = put_back(name, rolled.strategy, rolled.saved_strategy)
    kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=strategic", "-p",
                 json.dumps(with_strategy(None, back)))
    after = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
    expected = own if not surging else {"type": "RollingUpdate", "rollingUpdate": own["rollingUpdate"]}
    assert after.strategy == expected and after.saved_strategy is None


def vllm_deployment(kube, namespace: str, name: str) -> None:
    """A Deployment of no replicas running `vllm serve`-shaped args: only its template is patched."""
    kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}}, "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                             "args": ["--model", "m"]}]}}}})


def test_compiled_state_on_and_off_merges_cleanly(kube, namespace):
    """serving.compiledState on, then off: the harvest sidecar, the cache emptyDir, the loader's and vLLM's
    mounts of it and VLLM_CACHE_ROOT all go, and the claim is read-only again; no patch is refused."""
    from ferry_operator.serving.compiled import HARVEST_CONTAINER
    name = "compiled"
    vllm_deployment(kube, namespace, name)
    artifact = Artifact(uri="pvc://llama-weights/llama/0b7e/8bcdf0a3ee78/artifact", format="sharded_state",
                        total_bytes=1 << 20, manifest_digest=DIGEST)

    def wire(mode: str) -> dict:
        current = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
        s = parse(with_("serving.compiledState", {"mode": mode})).spec
        patch = template_patch(s, "llama", artifact, "vllm", current, LoaderSettings(image="ferry.local/f:1"))
        assert patch is not None
        kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=strategic", "-p", json.dumps(patch))
        return kube.get_json("deployment", name, "-n", namespace)["spec"]["template"]["spec"]

    on = wire("AfterFirstReady")
    assert [c["name"] for c in on["initContainers"]] == ["ferry-load", HARVEST_CONTAINER]
    assert on["initContainers"][1]["restartPolicy"] == "Always"
    (claim,) = [v for v in on["volumes"] if "persistentVolumeClaim" in v]
    assert not claim["persistentVolumeClaim"].get("readOnly")  # false is left out
    off = wire("Off")
    assert [c["name"] for c in off["initContainers"]] == ["ferry-load"]
    assert {v["name"] for v in off["volumes"]} == {"ferry-weights", "ferry-loader-token"}
    (claim,) = [v for v in off["volumes"] if "persistentVolumeClaim" in v]
    assert claim["persistentVolumeClaim"]["readOnly"] is True
    mounts = [m["mountPath"] for c in off["initContainers"] + off["containers"] for m in c.get("volumeMounts", [])]
    assert not [m for m in mounts if m.startswith("/ferry/compiled")], mounts
    assert not [e for e in off["containers"][0].get("env", []) if e["name"] == "VLLM_CACHE_ROOT"]


def test_compiled_state_moving_between_a_claim_and_s3_merges_cleanly(kube, namespace):
    """The store follows the artifact: S3 beside one Ferry published there, the claim beside one on a claim.
    Each move deletes what the other store's wiring added (the store volume and mounts; the scratch volume,
    its mount, the S3 env and TMPDIR of the harvest); every patch is accepted and leaves the template at rest.
    A moved credentialsSecretRef rewires the three containers that read S3; under the node cache vLLM holds
    no S3 credentials and Ferry's two containers keep theirs."""
    from ferry_operator.serving.compiled import HARVEST_CONTAINER
    name = "compiled-moves"
    vllm_deployment(kube, namespace, name)
    claim = Artifact(uri="pvc://llama-weights/llama/0b7e/8bcdf0a3ee78/artifact", format="sharded_state",
                     total_bytes=1 << 20, manifest_digest=DIGEST)
    s3 = Artifact(uri="s3://ferry-artifacts/llama/ml/llama/0b7e/abc", format="runai_streamer", total_bytes=1 << 20,
                  manifest_digest="sha256:" + "4" * 64)
    loader = LoaderSettings(image="ferry.local/f:1")

    def wire(where: str, mode: str = "AfterFirstReady", secret: str = "s3-creds", cache: bool = False) -> dict:
        current = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
        base = with_("storage.s3.credentialsSecretRef", {"name": secret}, RUNAI_S3) if where == "s3" else None
        s = parse(with_("serving.nodeCache", {"enabled": cache}, with_("serving.compiledState", {"mode": mode},
                                                                        base))).spec
        artifact = s3 if where == "s3" else claim
        patch = template_patch(s, "llama", artifact, "vllm", current, loader)
        assert patch is not None
        kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=strategic", "-p", json.dumps(patch))
        after = kube.get_json("deployment", name, "-n", namespace)
        assert template_patch(s, "llama", artifact, "vllm", deployment_facts(after), loader) is None  # at rest
        return after["spec"]["template"]["spec"]

    def harvest(pod: dict) -> dict:
        return next(c for c in pod["initContainers"] if c["name"] == HARVEST_CONTAINER)

    for where in ("s3", "claim", "s3"):
        pod = wire(where)
        volumes = {v["name"] for v in pod["volumes"]}
        mounts = {m["mountPath"] for m in harvest(pod)["volumeMounts"]}
        env = {e["name"] for e in harvest(pod).get("env") or []}
        store = harvest(pod)["args"][harvest(pod)["args"].index("--store") + 1]
        if where == "s3":
            assert store == "s3://ferry-artifacts/llama/ml/llama/0b7e/compiled"
            assert "ferry-compiled-scratch" in volumes and "ferry-compiled-store" not in volumes
            assert mounts == {"/ferry/compiled", "/ferry/compiled-scratch"} and {"AWS_ACCESS_KEY_ID", "TMPDIR"} <= env
        else:
            assert store == "/ferry/compiled-store/compiled" and "ferry-compiled-scratch" not in volumes
            assert mounts == {"/ferry/compiled", "/ferry/compiled-store"} and not env, env
        loader_mounts = {m["mountPath"] for m in pod["initContainers"][0]["volumeMounts"]}
        assert ("/ferry/compiled-store" in loader_mounts) is (where == "claim"), loader_mounts
    # A moved credentialsSecretRef (not in the key) reaches the vLLM container, the loader and the harvest.
    def refs(c: dict) -> set[str]:
        return {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env") or []
                if "secretKeyRef" in e.get("valueFrom", {})}
    pod = wire("s3", secret="s3-creds-2")
    for c in (pod["containers"][0], pod["initContainers"][0], harvest(pod)):
        assert refs(c) == {"s3-creds-2"}, (c["name"], refs(c))
    # Weights from the node cache: vLLM's S3 env goes, the loader and the harvest keep theirs (the state's
    # store); and back.
    pod = wire("s3", secret="s3-creds-2", cache=True)
    assert refs(pod["containers"][0]) == set() and not any(
        e["name"].startswith("AWS_") for e in pod["containers"][0].get("env") or [])
    assert refs(pod["initContainers"][0]) == refs(harvest(pod)) == {"s3-creds-2"}
    pod = wire("s3", secret="s3-creds-2")
    assert refs(pod["containers"][0]) == refs(pod["initContainers"][0]) == {"s3-creds-2"}
    off = wire("s3", "Off")
    assert [c["name"] for c in off["initContainers"]] == ["ferry-load"]
    assert not [v for v in off["volumes"] if v["name"].startswith("ferry-compiled")], off["volumes"]


def test_ferrys_s3_env_follows_the_spec_and_leaves_the_users_own(kube, namespace):
    """Ferry's S3 env (endpoint, region, credentials by named key) in vLLM's container and the loader: a
    region and a credential over the user's own entries of those names (ConfigMap references: Ferry's
    replace them, not merged into invalid entries), an endpoint removed from the spec (its entries go from both), the node
    cache turned on (vLLM keeps none of Ferry's), an artifact moved to a claim (none anywhere); every patch
    accepted and at rest, the user's other env untouched. A template Ferry wired before it recorded its
    names (no annotation) is at rest as it is: no rollout on upgrade; an entry of one of those names the user
    adds once Ferry no longer writes it is hers."""
    from ferry_operator.serving.s3_env import S3_ENV_ANNOTATION
    name = "s3-env"
    kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}}, "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                             "args": ["--model", "m"], "env": [
                                                 {"name": "HF_HOME", "value": "/cache"},
                                                 {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"configMapKeyRef": {
                                                     "name": "aws", "key": "id"}}},
                                                 {"name": "AWS_DEFAULT_REGION", "valueFrom": {"configMapKeyRef": {
                                                     "name": "aws", "key": "region"}}}]}]}}}})
    s3 = Artifact(uri="s3://ferry-artifacts/llama/abc", format="runai_streamer", total_bytes=1 << 20,
                  manifest_digest=DIGEST)
    claim = Artifact(uri="pvc://llama-weights/llama/0b7e/8bcdf0a3ee78/artifact", format="runai_streamer",
                     total_bytes=1 << 20, manifest_digest="sha256:" + "5" * 64)
    loader = LoaderSettings(image="ferry.local/f:1")

    def wire(artifact, s3_fields: dict, cache: bool = False) -> tuple[dict, dict]:
        current = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
        obj = with_("storage.s3", {"uri": "s3://ferry-artifacts/llama", "credentialsSecretRef": {"name": "creds"},
                                   **s3_fields}, with_("serving.nodeCache", {"enabled": cache}, RUNAI_S3))
        s = parse(obj).spec
        patch = template_patch(s, "llama", artifact, "vllm", current, loader)
        assert patch is not None
        kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=strategic", "-p", json.dumps(patch))
        after = kube.get_json("deployment", name, "-n", namespace)
        assert template_patch(s, "llama", artifact, "vllm", deployment_facts(after), loader) is None  # at rest
        pod = after["spec"]["template"]["spec"]
        envs = {c["name"]: {e["name"]: e for e in c.get("env") or []} for c in pod["containers"] + pod["initContainers"]}
        return envs["vllm"], envs["ferry-load"]

    vllm, init = wire(s3, {"endpoint": "http://minio:9000", "region": "eu-1"})
    assert vllm["AWS_DEFAULT_REGION"] == {"name": "AWS_DEFAULT_REGION", "value": "eu-1"}
    assert vllm["AWS_ACCESS_KEY_ID"]["valueFrom"] == {"secretKeyRef": {"name": "creds", "key": "AWS_ACCESS_KEY_ID",
                                                                       "optional": False}}
    assert vllm["AWS_ENDPOINT_URL"]["value"] == init["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000"
    vllm, init = wire(s3, {"region": "eu-1"})  # back to AWS's own endpoint
    assert "AWS_ENDPOINT_URL" not in vllm and "AWS_ENDPOINT_URL" not in init
    assert "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING" not in vllm and "AWS_ACCESS_KEY_ID" in vllm
    # Wired before Ferry recorded its names: as it is, it stays (no patch).
    kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=json", "-p", json.dumps([
        {"op": "remove", "path": "/spec/template/metadata/annotations/" + S3_ENV_ANNOTATION.replace("/", "~1")}]))
    legacy = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
    same = parse(with_("storage.s3", {"uri": "s3://ferry-artifacts/llama", "credentialsSecretRef": {"name": "creds"},
                                      "region": "eu-1"}, RUNAI_S3)).spec
    assert template_patch(same, "llama", s3, "vllm", legacy, loader) is None
    vllm, init = wire(s3, {"region": "eu-1"}, cache=True)
    assert not [n for n in vllm if n.startswith("AWS_") or n.startswith("RUNAI_")], vllm
    assert not [n for n in init if n.startswith("AWS_")], init
    vllm, init = wire(s3, {"region": "eu-1"})
    vllm, init = wire(claim, {"region": "eu-1"})
    assert not [n for n in vllm if n.startswith("AWS_")] and not [n for n in init if n.startswith("AWS_")]
    assert vllm["HF_HOME"] == {"name": "HF_HOME", "value": "/cache"}
    # The user's own entry of such a name, added now, is hers: the template stays at rest.
    kube.kubectl("patch", "deployment", name, "-n", namespace, "--type=json", "-p", json.dumps([
        {"op": "add", "path": "/spec/template/spec/containers/0/env/-", "value": {"name": "AWS_ENDPOINT_URL",
                                                                                 "value": "http://hers"}}]))
    hers = deployment_facts(kube.get_json("deployment", name, "-n", namespace))
    on_claim = parse(with_("storage.s3", {"uri": "s3://ferry-artifacts/llama", "credentialsSecretRef": {
        "name": "creds"}, "region": "eu-1"}, RUNAI_S3)).spec
    assert template_patch(on_claim, "llama", claim, "vllm", hers, loader) is None
