"""Job, claim and identity manifests of the kubernetes executor (pure)."""
from __future__ import annotations

from ferry_operator.api.validation import parse
from ferry_operator.executors import jobs
from ferry_operator.steps import prepare_steps
from spec_cases import manifest, with_

SETTINGS = jobs.WorkerSettings(image="ferry:dev")


def mw(obj):
    obj = {**obj, "metadata": {**obj["metadata"], "namespace": "ml"}}
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
    assert out[out.index("--output") + 1] == f"/weights/team-a/llama/{step.digest}/staging"
    assert jobs.artifact_uri(m, step.digest) == f"pvc://shared-models/team-a/llama/{step.digest}/artifact"


def test_pvc_source_is_mounted_read_only_and_read_as_files():
    m = mw(with_("source", {"uri": "pvc://model-cache/llama-3-70b"}))
    job = jobs.job_manifest(m, prepare_steps(m.spec)[0], "uid", SETTINGS)
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--source") + 1] == "file:///source/llama-3-70b"
    assert {"name": "source", "persistentVolumeClaim": {"claimName": "model-cache", "readOnly": True}} in pod["volumes"]
    assert {"name": "source", "mountPath": "/source", "readOnly": True} in pod["containers"][0]["volumeMounts"]


def test_result_parsing_ignores_anything_but_ferry_json():
    assert jobs.parse_result('{"manifestDigest": "sha256:00", "totalBytes": 1}')["totalBytes"] == 1
    assert jobs.parse_result("Traceback (most recent call last): ...") is None
    assert jobs.parse_result('{"other": 1}') is None
    assert jobs.parse_result("") is None


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


def tensorizer_mw(**tensorizer):
    return mw(manifest(format={"type": "tensorizer", "tensorParallelSize": 2, "tensorizer": tensorizer},
                       source={"uri": "s3://models/llama", "credentialsSecretRef": {"name": "source-creds"}},
                       storage={"pvc": {"size": "100Gi"},
                                "s3": {"uri": "s3://artifacts/llama", "endpoint": "http://minio:9000",
                                       "region": "eu-west-1", "credentialsSecretRef": {"name": "store-creds"}}}))


def test_tensorize_writes_to_its_own_prefix_with_the_stores_credentials_and_key():
    m = tensorizer_mw(encryptionSecretRef={"name": "tensorizer-key"})
    fetch, tensorize = prepare_steps(m.spec)
    settings = jobs.WorkerSettings(image="ferry:dev", tensorize_image="ferry-tensorize:dev")
    fetch_pod = jobs.job_manifest(m, fetch, "uid", settings)["spec"]["template"]["spec"]
    (fc,) = fetch_pod["containers"]
    assert fc["image"] == "ferry:dev" and fc["envFrom"] == [{"secretRef": {"name": "source-creds"}}]
    pod = jobs.job_manifest(m, tensorize, "uid", settings)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ferry-tensorize:dev" and "envFrom" not in c  # not the source's credentials
    args = c["args"]
    prefix = f"s3://artifacts/llama/ml/{m.metadata.name}/{tensorize.digest}"
    assert args[args.index("--output") + 1] == prefix == jobs.artifact_uri(m, tensorize.digest)
    assert args[args.index("--source") + 1] == f"/weights/{m.metadata.name}/{tensorize.digest}/staging"
    assert args[-2:] == ["--encryption-key-file", "/ferry/secrets/tensorizer/key"]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "store-creds"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000" and env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
    assert {"name": "tensorizer-key", "mountPath": "/ferry/secrets/tensorizer", "readOnly": True} in c["volumeMounts"]
    assert any(v.get("secret", {}).get("secretName") == "tensorizer-key" for v in pod["volumes"])


def test_s3_artifacts_are_removed_with_ferry_delete_artifact():
    m = tensorizer_mw()
    uri = jobs.artifact_uri(m, "abc123def456")
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
