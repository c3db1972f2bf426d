"""Job, claim and identity manifests of the kubernetes executor (pure)."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from ferry_operator.api.validation import parse
from ferry_operator.executors import jobs
from ferry_operator.locations import claim_artifact_uri
from ferry_operator.steps import prepare_steps
from spec_cases import manifest, with_

SETTINGS = jobs.WorkerSettings(image="ferry:dev")
REPO = Path(__file__).resolve().parent.parent


UID = "5f3c0d2e-uid"


def mw(obj, uid=UID):
    obj = {**obj, "metadata": {**obj["metadata"], "namespace": "ml", "uid": uid}}
    return parse(obj)


def test_long_names_stay_valid_labels():
    name = jobs.dns_name("a" * 60, "fetch", "0123abcd")
    assert len(name) == 63 and name == jobs.dns_name("a" * 60, "fetch", "0123abcd")
    assert jobs.dns_name("a" * 60, "fetch", "0123abcd") != jobs.dns_name("a" * 60, "shard", "0123abcd")


def test_retain_keeps_the_claim_past_the_modelweights():
    m = mw(manifest())
    pvc = jobs.pvc_manifest(m, "uid-1")
    assert "ownerReferences" not in pvc["metadata"]
    assert pvc["spec"] == {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}},
                           "storageClassName": "fast"}
    deleting = mw(with_("deletionPolicy", "Delete"))
    assert jobs.pvc_manifest(deleting, "uid-1")["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_an_existing_claim_is_reused_not_created():
    m = mw(with_("storage.pvc", {"name": "shared-models", "subPath": "team-a/llama"}))
    assert jobs.pvc_manifest(m, "uid") is None
    step = prepare_steps(m.spec)[0]
    job = jobs.job_manifest(m, step, "uid", SETTINGS)
    assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "shared-models"
    out = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert out[out.index("--output") + 1] == f"/weights/team-a/llama/{UID}/{step.digest}/staging"
    assert claim_artifact_uri(m, step.digest) == f"pvc://shared-models/team-a/llama/{UID}/{step.digest}/artifact"


def test_two_objects_on_one_claim_and_subpath_never_share_a_directory():
    """Same claim, same subPath, same spec (so the same spec digest): their
    directories differ by uid, and each cleanup removes its own only."""
    spec = with_("storage.pvc", {"name": "shared-models", "subPath": "llama"})
    first, second = mw(spec, uid="uid-first"), mw(spec, uid="uid-second")
    digest = prepare_steps(first.spec)[-1].digest
    assert digest == prepare_steps(second.spec)[-1].digest
    targets = [jobs.cleanup_job_manifest(m, digest, "x", SETTINGS)["spec"]["template"]["spec"]["containers"][0]
               ["command"][-1] for m in (first, second)]
    assert targets == [f"/weights/llama/uid-first/{digest}", f"/weights/llama/uid-second/{digest}"]
    assert claim_artifact_uri(first, digest) != claim_artifact_uri(second, digest)
    with pytest.raises(ValueError, match="has no uid"):
        claim_artifact_uri(mw(spec, uid=None), digest)


def test_pvc_source_is_mounted_read_only_and_read_as_files():
    m = mw(with_("source", {"uri": "pvc://model-cache/llama-3-70b"}))
    job = jobs.job_manifest(m, prepare_steps(m.spec)[0], "uid", SETTINGS)
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--source") + 1] == "file:///source/llama-3-70b"
    assert {"name": "source", "persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True}} in pod["volumes"]
    assert {"name": "source", "mountPath": "/source", "readOnly": True} in pod["containers"][0]["volumeMounts"]


DIGEST = "sha256:" + "ab" * 32


def test_a_result_is_parsed_strictly():
    assert jobs.parse_result(json.dumps({"manifestDigest": DIGEST, "totalBytes": 3 << 20, "files": 7})) == \
        jobs.StepResult(manifest_digest=DIGEST, total_bytes=3 << 20)
    assert jobs.parse_result("") is None and jobs.parse_result(None) is None and jobs.parse_result(" \n") is None


def test_a_moe_results_facts_are_parsed_strictly_too():
    body = {"manifestDigest": DIGEST, "totalBytes": 1, "files": 3, "experts": 128, "expertParallel": True,
            "target": "blackwell"}
    assert jobs.parse_result(json.dumps(body)) == jobs.StepResult(DIGEST, 1, experts=128, expert_parallel=True,
                                                                 target="blackwell")
    # An older worker, or a dense model: no facts.
    assert jobs.parse_result(json.dumps({"manifestDigest": DIGEST, "totalBytes": 1})).experts is None


@pytest.mark.parametrize("facts,words", [
    ({"experts": True}, "experts True is not an integer in [0, 65536]"),
    ({"experts": -1}, "experts -1 "),
    ({"experts": 1 << 20}, "experts 1048576 "),
    ({"experts": "8"}, "experts '8' "),
    ({"expertParallel": 1}, "expertParallel 1 is not true or false"),
    ({"expertParallel": "true"}, "expertParallel 'true' "),
    ({"target": "h100"}, "target 'h100' is not one of ada, ampere, blackwell, hopper, rocm"),
    ({"target": ["hopper"]}, "target ['hopper'] "),
])
def test_a_malformed_moe_fact_raises_naming_it(facts, words):
    with pytest.raises(jobs.MalformedResult, match=re.escape(words)):
        jobs.parse_result(json.dumps({"manifestDigest": DIGEST, "totalBytes": 1, **facts}))


@pytest.mark.parametrize("message,words", [
    ("Traceback (most recent call last): ...", "not JSON"),
    ('["sha256:..."]', "not a JSON object"),
    ('{"other": 1}', "no manifestDigest in ['other']"),
    ('{"manifestDigest": "sha256:00", "totalBytes": 1}', "manifestDigest 'sha256:00' is not sha256:<64 hex digits>"),
    (json.dumps({"manifestDigest": DIGEST.upper(), "totalBytes": 1}), "is not sha256:<64 hex digits>"),
    (json.dumps({"manifestDigest": DIGEST + "\n", "totalBytes": 1}), "is not sha256:<64 hex digits>"),
    (json.dumps({"manifestDigest": "../../etc", "totalBytes": 1}), "manifestDigest '../../etc'"),
    (json.dumps({"manifestDigest": DIGEST}), "no totalBytes in ['manifestDigest']"),
    (json.dumps({"manifestDigest": DIGEST, "totalBytes": -1}), "totalBytes -1 is not a non-negative integer"),
    (json.dumps({"manifestDigest": DIGEST, "totalBytes": 1.5}), "totalBytes 1.5 "),
    (json.dumps({"manifestDigest": DIGEST, "totalBytes": "12"}), "totalBytes '12'"),
    (json.dumps({"manifestDigest": DIGEST, "totalBytes": True}), "totalBytes True "),
    ("token=hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567 Traceback", "not JSON: 'token=[REDACTED]"),
])
def test_a_malformed_result_raises_naming_what_is_wrong(message, words):
    with pytest.raises(jobs.MalformedResult, match=re.escape(words)):
        jobs.parse_result(message)


def test_bad_input_fails_the_job_at_once_and_disruptions_do_not_count():
    from ferry_worker.results import EXIT_INPUT

    m = mw(manifest())
    spec = jobs.job_manifest(m, prepare_steps(m.spec)[0], "uid", SETTINGS)["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires
    fail_job, ignore = spec["podFailurePolicy"]["rules"]
    assert fail_job == {"action": "FailJob", "onExitCodes": {"containerName": "worker", "operator": "In",
                                                             "values": [EXIT_INPUT]}}
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert spec["backoffLimit"] == 3  # crashes and OOM kills still retry


def tensorizer_mw_manifest(**tensorizer):
    return manifest(format={"type": "tensorizer", "tensorParallelSize": 2, "tensorizer": tensorizer},
                    source={"uri": "s3://models/llama", "credentialsSecretRef": {"name": "source-creds"}},
                    storage={"pvc": {"size": "100Gi"},
                             "s3": {"uri": "s3://artifacts/llama", "endpoint": "http://minio:9000",
                                    "region": "eu-west-1", "credentialsSecretRef": {"name": "store-creds"}}})


def tensorizer_mw(**tensorizer):
    return mw(tensorizer_mw_manifest(**tensorizer))


def test_tensorize_writes_to_its_own_prefix_with_the_stores_credentials_and_key():
    m = tensorizer_mw(encryptionSecretRef={"name": "tensorizer-key"})
    fetch, tensorize = prepare_steps(m.spec)
    settings = jobs.WorkerSettings(image="ferry:dev", tensorize_image="ferry-tensorize:dev")
    fetch_pod = jobs.job_manifest(m, fetch, "uid", settings)["spec"]["template"]["spec"]
    (fc,) = fetch_pod["containers"]
    assert fc["image"] == "ferry:dev" and "envFrom" not in fc
    source = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in fc["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert source["AWS_ACCESS_KEY_ID"] == {"name": "source-creds", "key": "AWS_ACCESS_KEY_ID", "optional": False}
    assert source["AWS_ENDPOINT_URL"] == {"name": "source-creds", "key": "AWS_ENDPOINT_URL", "optional": True}
    pod = jobs.job_manifest(m, tensorize, "uid", settings)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ferry-tensorize:dev" and "envFrom" not in c  # not the source's credentials
    args = c["args"]
    prefix = f"s3://artifacts/llama/ml/{m.metadata.name}/{UID}/{tensorize.digest}"
    assert args[args.index("--output") + 1] == prefix == claim_artifact_uri(m, tensorize.digest)
    assert args[args.index("--source") + 1] == f"/weights/{m.metadata.name}/{UID}/{tensorize.digest}/staging"
    assert args[-2:] == ["--encryption-key-file", "/ferry/secrets/tensorizer/key"]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "store-creds"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000" and env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
    assert {"name": "tensorizer-key", "mountPath": "/ferry/secrets/tensorizer", "readOnly": True} in c["volumeMounts"]
    assert any(v.get("secret", {}).get("secretName") == "tensorizer-key" for v in pod["volumes"])


def test_s3_artifacts_are_removed_with_ferry_delete_artifact():
    m = tensorizer_mw()
    uri = claim_artifact_uri(m, "abc123def456")
    gc = jobs.cleanup_job_manifest(m, "abc123def456", "uid", SETTINGS, s3_uri=uri)
    (c,) = gc["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["sh", "-c"] and "ferry delete-artifact" in c["command"][2] and c["command"][3] == uri
    assert {e["name"] for e in c["env"]} >= {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL"}
    at_deletion = jobs.s3_delete_job_manifest(m, uri, SETTINGS)
    assert "ownerReferences" not in at_deletion["metadata"]  # it must outlive the ModelWeights
    (d,) = at_deletion["spec"]["template"]["spec"]["containers"]
    assert d["args"] == ["delete-artifact", uri] and at_deletion["spec"]["ttlSecondsAfterFinished"] > 0


def test_the_workers_progress_interval_is_passed_only_when_set():
    m = tensorizer_mw()
    fetch, _ = prepare_steps(m.spec)
    def env(settings):
        (c,) = jobs.job_manifest(m, fetch, "uid", settings)["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in c["env"]}
    assert "FERRY_PROGRESS_INTERVAL" not in env(SETTINGS)  # the worker's own default
    assert env(jobs.WorkerSettings(image="ferry:dev", progress_interval="0.5"))["FERRY_PROGRESS_INTERVAL"] == "0.5"


def all_jobs(m, settings=SETTINGS):
    """Every Job the executor makes for `m`: its prepare steps, a superseded artifact's cleanup, the deletion's."""
    uri = claim_artifact_uri(m, "abc123def456")
    made = {step.name: jobs.job_manifest(m, step, "uid", settings) for step in prepare_steps(m.spec)}
    on_s3 = uri.startswith("s3://")
    made["gc"] = jobs.cleanup_job_manifest(m, "abc123def456", "uid", settings, s3_uri=uri if on_s3 else None)
    if on_s3:
        made["delete"] = jobs.s3_delete_job_manifest(m, uri, settings)
    return made


def container(job):
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("obj,deadline", [
    (manifest(), 8192),  # a 200Gi claim at 25 MiB/s: past the 2h floor
    (with_("storage.pvc", {"size": "5Gi"}), 7200),  # the floor
    (with_("storage.pvc", {"name": "shared-models"}), 6 * 3600),  # a reused claim: size unknown
])
def test_every_prepare_job_has_a_deadline_derived_from_its_claims_size(obj, deadline):
    m = mw(obj)
    made = all_jobs(m)
    for step in prepare_steps(m.spec):
        assert made[step.name]["spec"]["activeDeadlineSeconds"] == deadline, step.name
    assert made["gc"]["spec"]["activeDeadlineSeconds"] == jobs.CLEANUP_DEADLINE_S == 3600


def test_the_charts_deadline_overrides_every_prepare_step_and_is_checked():
    m = tensorizer_mw()
    made = all_jobs(m, jobs.WorkerSettings(image="ferry:dev", active_deadline_seconds=900))
    assert {n: j["spec"]["activeDeadlineSeconds"] for n, j in made.items()} == {
        "fetch": 900, "tensorize": 900, "gc": 3600, "delete": 3600}
    assert jobs.parse_deadline("") is None and jobs.parse_deadline(" 7200 ") == 7200
    for bad in ("0", "-5", "2h", "1e3"):
        with pytest.raises(SystemExit, match="FERRY_WORKER_ACTIVE_DEADLINE_SECONDS=.*worker.activeDeadlineSeconds"):
            jobs.parse_deadline(bad)


S3_SOURCE = with_("source", {"uri": "s3://models/llama", "credentialsSecretRef": {"name": "source-creds"}})


@pytest.mark.parametrize("m", [tensorizer_mw(), mw(with_("format", {"type": "runai_streamer"},
                                                         base=tensorizer_mw_manifest())), mw(S3_SOURCE)],
                         ids=["tensorizer", "runai_streamer-publish", "s3-source"])
def test_jobs_never_use_the_nodes_instance_credentials_unless_the_chart_allows_it(m):
    guard = {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"}
    made = all_jobs(m)
    assert set(made) >= {"fetch", "gc"}
    for name, job in made.items():  # every Job's container, also those that happen not to talk to S3
        c = container(job)
        # Explicit env: it wins over an envFrom Secret that would set it too.
        assert guard in c["env"], name
    allowed = all_jobs(m, jobs.WorkerSettings(image="ferry:dev", allow_instance_credentials=True))
    for name, job in allowed.items():
        assert all(e["name"] != "AWS_EC2_METADATA_DISABLED" for e in container(job).get("env", [])), name


def test_file_sources_are_refused_by_the_job_builder():
    m = mw(with_("source", {"uri": "file:///var/run/secrets/kubernetes.io/serviceaccount"}))
    assert "file:// is for the local executor only" in jobs.unsupported_source(m)
    with pytest.raises(ValueError, match="use pvc://, s3:// or hf://"):
        jobs.job_manifest(m, prepare_steps(m.spec)[0], "uid", SETTINGS)
    assert jobs.unsupported_source(mw(manifest())) is None


def test_every_jobs_pod_is_non_root_and_placed_where_the_chart_says():
    settings = jobs.WorkerSettings(image="ferry:dev", node_selector={"pool": "cpu"},
                                   tolerations=[{"key": "batch", "operator": "Exists"}])
    for name, job in all_jobs(tensorizer_mw(), settings).items():
        pod = job["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["restartPolicy"] == "Never", name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"] == settings.tolerations, name
        assert container(job)["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert {"name": "tmp", "mountPath": "/tmp"} in container(job)["volumeMounts"], name
        # Only a step's worker reports progress with the ServiceAccount's token.
        assert pod.get("automountServiceAccountToken", True) is (name in ("fetch", "tensorize")), name
        assert ("fsGroup" in pod["securityContext"]) is (name != "delete"), name  # it mounts no claim


def operator_env(*sets: str) -> dict[str, str]:
    """The operator container's env as the chart renders it with `sets` (a real helm)."""
    import localcluster

    argv = [str(localcluster.binaries() / "helm"), "template", "ferry", str(REPO / "charts" / "ferry"),
            "--kube-version", "1.34.0", *[a for s in sets for a in ("--set", s)]]
    rendered = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    (dep,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in c["env"] if "value" in e}


@pytest.mark.helm
@pytest.mark.parametrize("sets,deadline,guarded", [
    ((), 8192, True),
    (("worker.activeDeadlineSeconds=1000000", "worker.allowInstanceCredentials=true"), 1000000, False),
])
def test_the_chart_values_reach_the_jobs(monkeypatch, sets, deadline, guarded):
    from ferry_operator import handlers

    for name, value in operator_env(*sets).items():
        monkeypatch.setenv(name, value)
    settings = handlers.make_executor().settings
    job = jobs.job_manifest(mw(manifest()), prepare_steps(mw(manifest()).spec)[0], "uid", settings)
    assert job["spec"]["activeDeadlineSeconds"] == deadline
    assert any(e["name"] == "AWS_EC2_METADATA_DISABLED" for e in container(job)["env"]) is guarded


def test_the_staging_directory_goes_once_the_artifact_is_recorded():
    m = mw(manifest())  # sharded_state: fetch into staging, then shard
    digest = prepare_steps(m.spec)[-1].digest
    job = jobs.staging_cleanup_job_manifest(m, digest, UID, SETTINGS)
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["rm", "-rf", "--one-file-system", f"/weights/{m.metadata.name}/{UID}/{digest}/staging"]
    assert job["metadata"]["labels"]["ferry.dev/step"] == "staging" and job["spec"]["activeDeadlineSeconds"] > 0
    assert job["metadata"]["name"] != jobs.cleanup_job_name(m, digest)


# --- Secrets by key, never whole ----------------------------------------------------------------

PVC_SOURCE = with_("source", {"uri": "pvc://team-models/llama", "credentialsSecretRef": {"name": "source-creds"}})
EVERY_KIND = {
    "hf-sharded_state": manifest(),
    "hf-safetensors": with_("format", {"type": "safetensors"}),
    "s3-source": S3_SOURCE,
    "pvc-source": PVC_SOURCE,
    "tensorizer-store": tensorizer_mw_manifest(encryptionSecretRef={"name": "tensorizer-key"}),
    "runai_streamer-publish": with_("format", {"type": "runai_streamer"}, base=tensorizer_mw_manifest()),
}


def every_job(m, settings=SETTINGS):
    """all_jobs, the staging cleanup, and a fill Job from each kind of artifact the node cache reads."""
    from ferry_operator.api.types import Artifact
    from ferry_operator.executors.cache_fill import fill_job_manifest

    made = all_jobs(m, settings)
    made["staging"] = jobs.staging_cleanup_job_manifest(m, "abc123def456", UID, settings)
    on_s3 = (m.spec.storage and m.spec.storage.s3) or m.spec.source.uri.startswith("s3://")
    for uri in ["pvc://llama-weights/llama/abc", *(["s3://artifacts/llama/ml/x"] if on_s3 else [])]:
        artifact = Artifact(uri=uri, format=m.spec.format.type, total_bytes=1 << 30,
                            manifest_digest="sha256:" + "1" * 64)
        made[f"fill {uri.split(':')[0]}"] = fill_job_manifest(m, UID, "gpu-a", artifact, 1, settings)
    return made


def secret_env(c):
    """(variable, Secret, key) of each env entry whose value comes from a Secret."""
    return [(e["name"], e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in c.get("env", []) if "secretKeyRef" in (e.get("valueFrom") or {})]


@pytest.mark.parametrize("obj", EVERY_KIND.values(), ids=EVERY_KIND.keys())
def test_no_job_imports_a_secret_whole_and_only_the_kinds_keys_reach_a_pod(obj):
    from ferry_operator.api.types import SECRET_KEYS

    m = mw(obj)
    allowed = {m.spec.source.credentials_secret_ref.name: set(SECRET_KEYS[m.spec.source.uri.split(":")[0]]),
               "store-creds": set(SECRET_KEYS["store"])}
    for name, job in every_job(m).items():
        pod = job["spec"]["template"]["spec"]
        for c in pod["containers"] + pod.get("initContainers", []):
            assert "envFrom" not in c, name
            for var, secret, key in secret_env(c):
                assert var == key and key in allowed[secret], (name, var, secret)
    # A PYTHONPATH or LD_PRELOAD key of the Secret has no way into a pod: no allowed name is one.
    assert not {"PYTHONPATH", "LD_PRELOAD", "AWS_EC2_METADATA_DISABLED", "HF_HOME"} & {
        k for keys in SECRET_KEYS.values() for k in keys}


def test_only_the_fetch_gets_the_sources_keys_and_the_credential_itself_is_required():
    m = mw(manifest())  # hf://, sharded_state: fetch, then shard
    fetch, shard = (container(jobs.job_manifest(m, s, UID, SETTINGS)) for s in prepare_steps(m.spec))
    hub_keys = ["HF_TOKEN", "HF_ENDPOINT", "REQUESTS_CA_BUNDLE", "HTTPS_PROXY", "HTTP_PROXY", "NO_PROXY"]
    assert [(v, s) for v, s, _ in secret_env(fetch)] == [(k, "hf-token") for k in hub_keys]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["optional"] for e in fetch["env"] if "valueFrom" in e
            and "secretKeyRef" in e["valueFrom"]}
    # Required: a missing Secret stops the pod (SecretNotFound, diagnosis.py) instead of a fetch without it.
    assert refs == {k: k != "HF_TOKEN" for k in hub_keys}
    assert secret_env(shard) == []  # the shard reads the claim, never the source
    assert secret_env(container(jobs.job_manifest(mw(PVC_SOURCE), prepare_steps(mw(PVC_SOURCE).spec)[0], UID,
                                                  SETTINGS))) == []


@pytest.mark.parametrize("obj", EVERY_KIND.values(), ids=EVERY_KIND.keys())
def test_metadata_is_off_in_every_job_fill_jobs_included_and_no_env_name_is_set_twice(obj):
    guard = {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"}
    m = mw(obj)
    for name, job in every_job(m).items():
        c = container(job)
        assert guard in c["env"], name
        names = [e["name"] for e in c["env"]]
        # One entry per name, and no Secret behind Ferry's own (no envFrom exists to override them either).
        assert len(names) == len(set(names)), (name, names)
        assert "AWS_EC2_METADATA_DISABLED" not in {v for v, _, _ in secret_env(c)}, name
    allowed = jobs.WorkerSettings(image="ferry:dev", allow_instance_credentials=True)
    for name, job in every_job(m, allowed).items():
        if not name.startswith("fill s3"):  # storage.s3.endpoint is off AWS: no metadata service there
            assert guard not in container(job)["env"], name
