"""Why a prepare Job does not progress, from the Job, its pods and claims as the
API server serves them (pure; no cluster).

The pod statuses below are written the way a v1.34 kubelet, scheduler and Job
controller write them: waiting reasons and messages from
pkg/kubelet/images/image_manager.go and kuberuntime_container.go (the
envFrom Secret lookup's NotFound error), the scheduler's Unschedulable
condition, the Job controller's FailureTarget/Failed conditions and its
podFailurePolicy message. kubelet_v1_34_jobs.json holds what a real v1.34
kubelet wrote for the same failures (the last tests).
"""
from __future__ import annotations

import copy
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.executors import diagnosis, jobs
from ferry_operator.executors.diagnosis import diagnose
from ferry_operator.executors.redact import redact
from ferry_operator.locations import claim_artifact_uri
from ferry_operator.planner import StepPhase
from ferry_operator.steps import prepare_steps
from spec_cases import manifest, with_

NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=timezone.utc)
IMAGE = "ghcr.io/ferry-dev/ferry:0.1.0"
SETTINGS = jobs.WorkerSettings(image=IMAGE)


def ago(seconds: float) -> str:
    return (NOW - timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_job(obj=None, created=120, conditions=(), **status):
    mw = parse({**(obj or manifest()), "metadata": {"name": "llama", "namespace": "ml", "uid": "mw-uid"}})
    job = jobs.job_manifest(mw, prepare_steps(mw.spec)[0], "mw-uid", SETTINGS)
    job["metadata"].update(namespace="ml", uid="job-uid", creationTimestamp=ago(created))
    job["status"] = {"startTime": ago(created), "active": 1, "ready": 0, "terminating": 0,
                     "uncountedTerminatedPods": {}, **status}
    if conditions:
        job["status"]["conditions"] = list(conditions)
    return job


JOB = make_job()
JOB_NAME = JOB["metadata"]["name"]


def job_condition(type_, reason, message):
    return {"type": type_, "status": "True", "reason": reason, "message": message,
            "lastProbeTime": ago(1), "lastTransitionTime": ago(1)}


def pod(suffix="x7k2p", created=60, phase="Pending", node="gpu-node-1", waiting=None, terminated=None,
        conditions=None, **status):
    """A Job pod as the API serves it; `waiting`/`terminated`: the worker container's state."""
    name = f"{JOB_NAME}-{suffix}"
    spec = copy.deepcopy(JOB["spec"]["template"]["spec"])
    if node:
        spec["nodeName"] = node
    body = {
        "metadata": {"name": name, "namespace": "ml", "uid": f"pod-{suffix}", "creationTimestamp": ago(created),
                     "labels": {"batch.kubernetes.io/job-name": JOB_NAME, "job-name": JOB_NAME,
                                "batch.kubernetes.io/controller-uid": "job-uid", "controller-uid": "job-uid",
                                "ferry.dev/modelweights": "llama", "ferry.dev/step": "fetch"},
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": JOB_NAME,
                                          "uid": "job-uid", "controller": True, "blockOwnerDeletion": True}],
                     "finalizers": ["batch.kubernetes.io/job-tracking"]},
        "spec": spec,
        "status": {"phase": phase, "qosClass": "Burstable", **status},
    }
    if conditions is not None:
        body["status"]["conditions"] = conditions
    elif node:
        body["status"]["conditions"] = [
            {"type": "PodReadyToStartContainers", "status": "True", "lastProbeTime": None,
             "lastTransitionTime": ago(created - 1)},
            {"type": "Initialized", "status": "True", "lastProbeTime": None, "lastTransitionTime": ago(created - 1)},
            {"type": "Ready", "status": "False", "lastProbeTime": None, "lastTransitionTime": ago(created - 1),
             "reason": "ContainersNotReady", "message": "containers with unready status: [worker]"},
            {"type": "ContainersReady", "status": "False", "lastProbeTime": None,
             "lastTransitionTime": ago(created - 1), "reason": "ContainersNotReady",
             "message": "containers with unready status: [worker]"},
            {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": ago(created)},
        ]
    if node:
        body["status"].update(hostIP="10.0.0.5", hostIPs=[{"ip": "10.0.0.5"}], startTime=ago(created - 1))
    if waiting is not None or terminated is not None:
        state = {"waiting": waiting} if waiting is not None else {"terminated": terminated}
        body["status"]["containerStatuses"] = [{
            "name": "worker", "state": state, "lastState": {}, "ready": False, "restartCount": 0,
            "image": IMAGE, "imageID": "" if waiting is not None else f"{IMAGE.split(':')[0]}@sha256:{'ab' * 32}",
            "started": False,
            **({"containerID": "containerd://" + "0f" * 32} if terminated is not None else {}),
            "volumeMounts": [{"name": "weights", "mountPath": "/weights"},
                             {"name": "tmp", "mountPath": "/tmp"},
                             {"name": "kube-api-access-9xk2f", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
                              "readOnly": True, "recursiveReadOnly": "Disabled"}],
        }]
    return body


def unschedulable(message, created=30):
    return pod(created=created, node=None, conditions=[
        {"type": "PodScheduled", "status": "False", "lastProbeTime": None, "lastTransitionTime": ago(created),
         "reason": "Unschedulable", "message": message}])


def failed_pod(suffix, exit_code, message, reason="Error", created=120):
    return pod(suffix=suffix, created=created, phase="Failed", terminated={
        "exitCode": exit_code, "reason": reason, "message": message, "startedAt": ago(created - 5),
        "finishedAt": ago(created - 30)})


def claim(name="llama-weights", storage_class="fast", phase="Pending", created=60, ours=True):
    meta = {"name": name, "namespace": "ml", "uid": "pvc-uid", "creationTimestamp": ago(created),
            "finalizers": ["kubernetes.io/pvc-protection"]}
    if ours:
        meta["labels"] = {"ferry.dev/modelweights": "llama"}
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "200Gi"}},
            "volumeMode": "Filesystem"}
    if storage_class is not None:
        spec["storageClassName"] = storage_class
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def run(job=JOB, pods=(), claims=None, classes=None, **kwargs):
    return diagnose(job, list(pods), claims, classes, now=NOW, **kwargs)


# --- a missing Secret ---------------------------------------------------------------------------

def test_a_missing_credentials_secret_fails_at_once_and_says_what_to_do():
    p = pod(waiting={"reason": "CreateContainerConfigError", "message": 'secret "hf-token" not found'})
    state = run(pods=[p])
    assert state.phase == StepPhase.FAILED and state.reason == "SecretNotFound"
    assert "Secret ml/hf-token (spec.source.credentialsSecretRef) does not exist" in state.message
    assert "create it in namespace ml, or fix spec.source.credentialsSecretRef" in state.message


def test_a_secret_without_the_required_key_fails_at_once_naming_the_key_and_the_field():
    p = pod(waiting={"reason": "CreateContainerConfigError",
                     "message": "couldn't find key HF_TOKEN in Secret ml/hf-token"})
    state = run(pods=[p])
    assert state.phase == StepPhase.FAILED and state.reason == "SecretNotFound"
    assert state.message.startswith("Secret ml/hf-token (spec.source.credentialsSecretRef) has no key HF_TOKEN, ")
    assert "add it to the Secret, or fix spec.source.credentialsSecretRef" in state.message


def test_a_missing_store_secret_is_named_by_its_own_field():
    obj = manifest(format={"type": "tensorizer", "tensorParallelSize": 2},
                   storage={"pvc": {"size": "100Gi"}, "s3": {"uri": "s3://artifacts/llama",
                                                            "credentialsSecretRef": {"name": "store-creds"}}})
    m = parse({**obj, "metadata": {"name": "llama", "namespace": "ml", "uid": "mw-uid"}})
    job = make_job(obj)
    job["spec"] = jobs.job_manifest(m, prepare_steps(m.spec)[1], "mw-uid", SETTINGS)["spec"]  # tensorize
    job["metadata"]["labels"]["ferry.dev/step"] = "tensorize"
    p = pod(waiting={"reason": "CreateContainerConfigError", "message": 'secret "store-creds" not found'})
    state = run(job=job, pods=[p])
    assert state.reason == "SecretNotFound"
    assert "Secret ml/store-creds (spec.storage.s3.credentialsSecretRef) does not exist" in state.message


def test_a_secret_cache_hiccup_is_not_a_failure():
    p = pod(waiting={"reason": "CreateContainerConfigError",
                     "message": "failed to sync secret cache: timed out waiting for the condition"})
    state = run(pods=[p])
    assert state.phase == StepPhase.RUNNING and state.reason == "ContainerConfigError"
    assert "failed to sync secret cache" in state.message


# --- images -------------------------------------------------------------------------------------

def test_an_image_not_on_the_node_with_pull_policy_never_fails_at_once():
    p = pod(created=2, waiting={"reason": "ErrImageNeverPull",
                                "message": f'Container image "{IMAGE}" is not present with pull policy of Never'})
    state = run(pods=[p])
    assert state.phase == StepPhase.FAILED and state.reason == "ImageNotFound"
    assert f'image "{IMAGE}" is not on node gpu-node-1' in state.message
    assert "worker.image" in state.message and "image.repository:image.tag" in state.message


def test_an_invalid_image_name_fails_at_once():
    bad = "ghcr.io/Ferry-Dev/ferry:0.1.0"
    p = pod(created=2, waiting={"reason": "InvalidImageName", "message": (
        f'Failed to apply default image tag "{bad}": couldn\'t parse image name "{bad}": invalid reference '
        "format: repository name (Ferry-Dev/ferry) must be lowercase")})
    p["spec"]["containers"][0]["image"] = bad
    state = run(pods=[p])
    assert state.phase == StepPhase.FAILED and state.reason == "InvalidImageName"
    assert f'image "{bad}" is not a valid image reference' in state.message and "must be lowercase" in state.message


NOT_FOUND = (f'rpc error: code = NotFound desc = failed to pull and unpack image "{IMAGE}": failed to resolve '
             f'reference "{IMAGE}": {IMAGE}: not found')
DENIED = (f'rpc error: code = Unknown desc = failed to pull and unpack image "{IMAGE}": failed to resolve reference '
          f'"{IMAGE}": pull access denied, repository does not exist or may require authorization: server message: '
          "insufficient_scope: authorization failed")
DNS = (f'rpc error: code = Unknown desc = failed to pull and unpack image "{IMAGE}": failed to resolve reference '
       f'"{IMAGE}": failed to do request: Head "https://ghcr.io/v2/ferry-dev/ferry/manifests/0.1.0": dial tcp: '
       "lookup ghcr.io on 10.96.0.10:53: server misbehaving")


@pytest.mark.parametrize("waiting", [
    {"reason": "ErrImagePull", "message": NOT_FOUND},
    # The v1.34 kubelet keeps the last pull error in the back-off message.
    {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{IMAGE}": ErrImagePull: {NOT_FOUND}'},
    {"reason": "ErrImagePull", "message": DENIED},
    # As the v1.34 kubelet of the local cluster words containerd 1.6's errors (no gRPC prefix).
    {"reason": "ImagePullBackOff", "message": (
        f'Back-off pulling image "{IMAGE}": ErrImagePull: failed to pull and unpack image "{IMAGE}": failed to '
        f'resolve reference "{IMAGE}": {IMAGE}: not found')},
], ids=["not-found", "back-off-not-found", "denied", "containerd-not-found"])
def test_the_registry_saying_no_fails_at_once(waiting):
    state = run(pods=[pod(created=3, waiting=waiting)])
    assert state.phase == StepPhase.FAILED and state.reason == "ImageNotFound"
    assert f'image "{IMAGE}" cannot be pulled on node gpu-node-1' in state.message
    assert "worker.image" in state.message and waiting["message"][-40:] in state.message


def test_other_pull_errors_get_a_few_attempts_then_fail():
    waiting = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{IMAGE}": ErrImagePull: {DNS}'}
    early = run(pods=[pod(created=25, waiting=waiting)])
    assert early.phase == StepPhase.RUNNING and early.reason == "ImagePullBackOff"
    assert "the kubelet retries" in early.message and "server misbehaving" in early.message
    late = run(pods=[pod(created=diagnosis.IMAGE_PULL_GRACE.total_seconds() + 5, waiting=waiting)])
    assert late.phase == StepPhase.FAILED and late.reason == "ImagePullFailed"
    assert f'image "{IMAGE}" could not be pulled on node gpu-node-1 for 6' in late.message
    # The back-off message without the previous error (an older kubelet): still retried, then failed.
    bare = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{IMAGE}"'}
    assert run(pods=[pod(created=25, waiting=bare)]).phase == StepPhase.RUNNING


def test_a_pulling_or_creating_container_is_just_running():
    for waiting in ({"reason": "ContainerCreating"}, {"reason": "PodInitializing"}):
        assert run(pods=[pod(waiting=waiting)]) == diagnosis.StepState(StepPhase.RUNNING)


# --- claims and scheduling ----------------------------------------------------------------------

PVC_UNBOUND = ("0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims. preemption: 0/1 nodes "
               "are available: 1 Preemption is not helpful for scheduling.")


def test_a_claim_whose_storage_class_does_not_exist_fails():
    p = unschedulable(PVC_UNBOUND)
    assert diagnosis.claims_to_read(JOB, [p]) == ["llama-weights"]
    claims = {"llama-weights": claim()}
    assert diagnosis.storage_classes_to_check(claims) == ["fast"]
    state = run(pods=[p], claims=claims, classes={"fast": False})
    assert state.phase == StepPhase.FAILED and state.reason == "StorageClassNotFound"
    assert state.message.startswith('PersistentVolumeClaim ml/llama-weights is Pending: StorageClass "fast" does '
                                    "not exist (spec.storage.pvc.storageClassName)")
    assert 'create StorageClass "fast"' in state.message


def test_a_claim_just_created_gets_a_moment_to_bind_to_a_static_volume():
    state = run(pods=[unschedulable(PVC_UNBOUND, created=1)], claims={"llama-weights": claim(created=1)},
                classes={"fast": False})
    assert state.phase == StepPhase.RUNNING and state.reason == "PersistentVolumeClaimPending"


def test_a_claim_waiting_for_its_provisioner_is_shown_while_pending():
    state = run(pods=[unschedulable(PVC_UNBOUND)], claims={"llama-weights": claim()}, classes={"fast": True})
    assert state.phase == StepPhase.RUNNING and state.reason == "PersistentVolumeClaimPending"
    assert 'PersistentVolumeClaim ml/llama-weights (spec.storage.pvc) is Pending: waiting for a volume of ' \
           'StorageClass "fast"' in state.message
    no_class = run(pods=[unschedulable(PVC_UNBOUND)], claims={"llama-weights": claim(storage_class=None)})
    assert no_class.phase == StepPhase.RUNNING and "names no StorageClass" in no_class.message


def test_a_reused_claim_that_does_not_exist_fails():
    job = make_job(with_("storage.pvc", {"name": "shared-models"}))
    p = unschedulable('0/1 nodes are available: persistentvolumeclaim "shared-models" not found. preemption: 0/1 '
                      "nodes are available: 1 Preemption is not helpful for scheduling.")
    assert diagnosis.claims_to_read(job, [p]) == ["shared-models"]
    state = run(job, [p], claims={"shared-models": None})
    assert state.phase == StepPhase.FAILED and state.reason == "PersistentVolumeClaimNotFound"
    assert "PersistentVolumeClaim ml/shared-models (spec.storage.pvc) does not exist" in state.message


def test_a_reused_claim_with_a_missing_class_names_its_own_field():
    job = make_job(with_("storage.pvc", {"name": "shared-models"}))
    state = run(job, [unschedulable(PVC_UNBOUND)], claims={"shared-models": claim("shared-models", ours=False)},
                classes={"fast": False})
    assert state.reason == "StorageClassNotFound"
    assert "the claim's spec.storageClassName, named by spec.storage.pvc" in state.message


def test_a_pvc_source_claim_is_checked_too():
    job = make_job(with_("source", {"uri": "pvc://model-cache/llama"}))
    assert diagnosis.claim_names(job) == ["llama-weights", "model-cache"]
    state = run(job, [unschedulable(PVC_UNBOUND)],
                claims={"llama-weights": claim(phase="Bound"), "model-cache": None})
    assert state.reason == "PersistentVolumeClaimNotFound" and "(spec.source.uri)" in state.message


def test_other_unschedulable_reasons_are_shown_while_pending_not_failed():
    p = unschedulable("0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 2 Insufficient "
                      "cpu. preemption: 0/3 nodes are available: 1 Preemption is not helpful for scheduling, 2 No "
                      "preemption victims found for incoming pod.")
    state = run(pods=[p], claims={"llama-weights": claim(phase="Bound")})
    assert state.phase == StepPhase.RUNNING and state.reason == "Unschedulable"
    assert state.message.startswith(f"pod ml/{p['metadata']['name']} cannot be scheduled: 0/3 nodes are available")
    assert "worker.nodeSelector" in state.message


def test_a_claim_waiting_for_its_first_consumer_leaves_the_word_to_the_scheduler():
    p = unschedulable("0/2 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 1 node(s) had "
                      "untolerated taint {nvidia.com/gpu: present}. preemption: 0/2 nodes are available: 2 Preemption "
                      "is not helpful for scheduling.")
    state = run(pods=[p], claims={"llama-weights": claim(storage_class="local-path")}, classes={"local-path": True})
    assert state.reason == "Unschedulable" and "didn't match Pod's node affinity/selector" in state.message


def test_claims_are_read_only_while_no_pod_is_scheduled():
    assert diagnosis.claims_to_read(JOB, [pod(waiting={"reason": "ContainerCreating"})]) == []
    assert diagnosis.claims_to_read(JOB, []) == ["llama-weights"]
    done = make_job(conditions=[job_condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods")])
    assert diagnosis.claims_to_read(done, []) == []


def test_a_job_that_makes_no_pod_says_where_to_look():
    assert run(make_job(created=5)) == diagnosis.StepState(StepPhase.RUNNING)
    state = run(make_job(created=45), [], claims={"llama-weights": claim(phase="Bound")})
    assert state.phase == StepPhase.RUNNING and state.reason == "PodNotCreated"
    assert f"Job ml/{JOB_NAME} has created no pod for 45s" in state.message and "kubectl describe job" in state.message


# --- the worker failing -------------------------------------------------------------------------

HUB_404 = ("fetch failed: 404 Client Error. (Request ID: Root=1-6650a1b2-3c4d5e6f7a8b9c0d1e2f3a4b)\n\n"
           "Repository Not Found for url: https://huggingface.co/api/models/meta-llama/Meta-Llama-3-70B-Instruct/"
           "revision/main.\nPlease make sure you specified the correct `repo_id` and `repo_type`.")


def test_a_bad_input_exit_fails_the_job_at_once_with_the_workers_words():
    message = f"Container worker for pod ml/{JOB_NAME}-x7k2p failed with exit code 2 matching FailJob rule at index 0"
    job = make_job(active=0, failed=1, conditions=[job_condition("FailureTarget", "PodFailurePolicy", message),
                                                   job_condition("Failed", "PodFailurePolicy", message)])
    state = run(job, [failed_pod("x7k2p", 2, HUB_404)])
    assert state.phase == StepPhase.FAILED and state.reason == "WorkerFailed"
    # The worker's report as one line, without its own "fetch failed: " (the planner says it).
    assert state.message.startswith("404 Client Error. (Request ID: Root=1-6650a1b2-3c4d5e6f7a8b9c0d1e2f3a4b) "
                                    "Repository Not Found for url:")
    assert "(exit code 2); the worker rejected its input, so the Job did not retry" in state.message
    assert not state.retryable  # the same input would fail the same way: the planner stalls
    # FailureTarget alone (pods still terminating) is already final.
    target = make_job(active=0, failed=1, conditions=[job_condition("FailureTarget", "PodFailurePolicy", message)])
    assert run(target, [failed_pod("x7k2p", 2, HUB_404)]).phase == StepPhase.FAILED


def test_a_failing_attempt_is_shown_while_the_job_retries():
    first = failed_pod("a1", 1, "fetch failed: s3://models/llama: model.safetensors: giving up at byte 0 after 6 "
                                "failures: Connection was closed before we received a valid response", created=90)
    state = run(make_job(failed=1), [first, pod(suffix="b2", created=20, waiting={"reason": "ContainerCreating"})])
    assert state.phase == StepPhase.RUNNING and state.reason == "Retrying"
    assert state.message.startswith("attempt 1 of 4 failed: s3://models/llama: model.safetensors: giving up at byte")
    assert state.message.endswith("(exit code 1); attempt 2 running")
    # Between attempts (the Job controller's back-off), no pod is live.
    between = run(make_job(active=0, failed=1), [first])
    assert between.reason == "Retrying" and between.message.endswith("attempt 2 pending")


def test_the_last_attempt_failing_reports_the_last_error_and_the_count():
    pods = [failed_pod(s, 1, f"fetch failed: attempt {i}", created=300 - 60 * i) for i, s in enumerate("abcd")]
    job = make_job(active=0, failed=4, conditions=[
        job_condition("FailureTarget", "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
        job_condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")])
    state = run(job, pods)
    assert state.phase == StepPhase.FAILED and state.reason == "WorkerFailed"
    assert state.message == "attempt 3 (exit code 1); all 4 attempts failed"
    assert state.retryable  # a crash may pass next time: the planner retries it with backoff


def test_a_crash_reports_the_log_tail_and_an_oom_kill_says_so():
    traceback = ("Traceback (most recent call last):\n  File \"/usr/local/bin/ferry\", line 8, in <module>\n"
                 "    sys.exit(main())\nSegmentation fault (core dumped)\n")
    crash = run(make_job(failed=1), [failed_pod("a1", 139, traceback)])
    assert "attempt 1 of 4 failed: Segmentation fault (core dumped) (exit code 139)" in crash.message
    oom = run(make_job(failed=1), [failed_pod("a1", 137, "ferry: fetching 30 files", reason="OOMKilled")])
    assert "ran out of memory (OOMKilled, exit code 137)" in oom.message and "worker.resources" in oom.message


def test_an_image_without_the_worker_says_so():
    message = ('failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create '
               'failed: unable to start container process: exec: "ferry": executable file not found in $PATH: unknown')
    state = run(make_job(failed=1), [failed_pod("a1", 128, message, reason="StartError")])
    assert "the worker container could not start (StartError, exit code 128)" in state.message
    assert 'exec: "ferry": executable file not found' in state.message and "worker.image" in state.message


def test_an_evicted_pod_is_told_apart_from_a_worker_error():
    evicted = pod(suffix="a1", phase="Failed", reason="Evicted", message=(
        "The node was low on resource: ephemeral-storage. Threshold quantity: 10Gi, available: 8Gi. Container "
        "worker was using 52Gi, request is 0, has larger consumption of ephemeral-storage. "),
        terminated={"exitCode": 137, "reason": "ContainerStatusUnknown",
                    "message": "The container could not be located when the pod was terminated"})
    evicted["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet",
                                            "message": "The node was low on resource: ephemeral-storage."})
    state = run(make_job(active=0, failed=1), [evicted])
    assert state.reason == "Retrying"
    assert f"pod ml/{JOB_NAME}-a1 Evicted: The node was low on resource: ephemeral-storage." in state.message


def test_complete_is_succeeded():
    job = make_job(active=0, succeeded=1, conditions=[
        job_condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
        job_condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods")])
    assert run(job, []).phase == StepPhase.SUCCEEDED


# --- the deadline ------------------------------------------------------------------------------

DEADLINE = "Job was active longer than specified deadline"  # the Job controller's words (v1.34)


def past_deadline(*types):
    job = make_job(created=8300, active=0, failed=1, terminating=1,
                   conditions=[job_condition(t, "DeadlineExceeded", DEADLINE) for t in types])
    # The Job controller deletes the running pod; it terminates on SIGTERM.
    killed = failed_pod("a1", 143, "ferry: fetching 30 files, 61% (86.0GiB of 141GiB)", created=8200)
    killed["metadata"]["deletionTimestamp"] = ago(2)
    return job, [killed]


@pytest.mark.parametrize("types", [("FailureTarget",), ("FailureTarget", "Failed")])
def test_a_job_past_its_deadline_fails_for_good_naming_the_deadline_and_the_chart_value(types):
    job, pods = past_deadline(*types)
    assert job["spec"]["activeDeadlineSeconds"] == 8192  # derived: a 200Gi claim
    state = run(job, pods)
    assert (state.phase, state.reason, state.retryable) == (StepPhase.FAILED, "DeadlineExceeded", False)
    assert state.message.startswith(f"Job ml/{JOB_NAME} ran past its deadline of 8192s (activeDeadlineSeconds)")
    assert "raise the chart's worker.activeDeadlineSeconds value" in state.message
    assert "kubectl annotate mw/llama -n ml ferry.dev/requested-at=" in state.message


def test_a_step_past_its_deadline_stalls_with_the_reason():
    from ferry_operator.planner import Observed, plan

    m = parse({**manifest(), "metadata": {"name": "llama", "namespace": "ml", "generation": 1, "uid": "mw-uid"}})
    fetch = prepare_steps(m.spec)[0]
    status = plan(m, Observed(steps={fetch.id: run(*past_deadline("Failed"))})).status
    stalled = next(c for c in status.conditions if c.type == "Stalled")
    assert (stalled.status, stalled.reason) == ("True", "DeadlineExceeded")
    assert stalled.message.startswith("fetch failed: Job ml/") and status.retry is None  # not retried by itself


# --- step results: only from the Job's own pods --------------------------------------------------

RESULT = {"manifestDigest": "sha256:" + "12" * 32, "totalBytes": 141 << 30, "files": 30}
FORGED = {"manifestDigest": "sha256:" + "66" * 32, "totalBytes": 1, "files": 1}


def complete(completed=60):
    return make_job(active=0, succeeded=1, completionTime=ago(completed), conditions=[
        job_condition("SuccessCriteriaMet", "CompletionsReached", "Reached expected number of succeeded pods"),
        job_condition("Complete", "CompletionsReached", "Reached expected number of succeeded pods")])


def succeeded_pod(suffix, message, created=120):
    return pod(suffix=suffix, created=created, phase="Succeeded", terminated={
        "exitCode": 0, "reason": "Completed", "message": message, "startedAt": ago(created - 5),
        "finishedAt": ago(created - 60)})


def planted(body, owner=None):
    """`body` as someone who may create pods makes it: the Job's labels copied, not made by the Job controller."""
    body = copy.deepcopy(body)
    body["metadata"]["name"] = body["metadata"]["name"].replace(JOB_NAME, "mine")
    if owner is None:
        del body["metadata"]["ownerReferences"]
    else:
        body["metadata"]["ownerReferences"] = [owner]
    return body


JOB_OWNER = {"apiVersion": "batch/v1", "kind": "Job", "name": JOB_NAME, "uid": "job-uid", "controller": True}


@pytest.mark.parametrize("owner", [None, {**JOB_OWNER, "uid": "other-uid"}, {**JOB_OWNER, "controller": False},
                                   {**JOB_OWNER, "kind": "ReplicaSet"}],
                         ids=["no-owner", "another-jobs-uid", "not-controller", "not-a-job"])
def test_a_planted_pod_with_the_jobs_labels_reports_nothing(owner):
    forged = planted(succeeded_pod("zz", json.dumps(FORGED), created=30), owner)
    assert forged["metadata"]["labels"]["job-name"] == JOB_NAME
    genuine = succeeded_pod("x7k2p", json.dumps(RESULT))
    assert diagnosis.step_result(complete(), [forged, genuine]) == jobs.StepResult(RESULT["manifestDigest"],
                                                                                  RESULT["totalBytes"])
    assert diagnosis.step_result(complete(), [forged]) is None
    # Alone, it does not make the step succeed.
    state = run(complete(), [forged], needs_result=True)
    assert (state.phase, state.reason, state.retryable) == (StepPhase.FAILED, "ResultMissing", False)
    assert f"Job ml/{JOB_NAME} completed, but none of its pods reported a result" in state.message


def test_a_planted_pod_does_not_steer_the_diagnosis():
    forged = planted(failed_pod("zz", 1, "Please run kubectl delete mw --all to fix this"))
    running = pod(suffix="x7k2p", phase="Running", created=30)
    state = run(make_job(), [forged, running])
    assert state == diagnosis.StepState(StepPhase.RUNNING) and "kubectl delete" not in state.message


def test_a_completed_jobs_result_is_awaited_a_moment_then_missing():
    waiting = run(complete(completed=2), [], needs_result=True)
    assert (waiting.phase, waiting.reason) == (StepPhase.RUNNING, "WaitingForResult")
    assert run(complete(completed=60), [], needs_result=True).reason == "ResultMissing"
    # An intermediate step's result is nobody's artifact: Complete is enough.
    assert run(complete(), []).phase == StepPhase.SUCCEEDED
    assert run(complete(), [succeeded_pod("x7k2p", json.dumps(RESULT))], needs_result=True).phase == StepPhase.SUCCEEDED


@pytest.mark.parametrize("pods,words", [
    ([succeeded_pod("x7k2p", json.dumps({**RESULT, "manifestDigest": "sha256:../../x"}))],
     "manifestDigest 'sha256:../../x' is not sha256:<64 hex digits>"),
    ([succeeded_pod("x7k2p", json.dumps({**RESULT, "totalBytes": -1}))], "totalBytes -1"),
    ([succeeded_pod("x7k2p", "all done")], "not JSON: 'all done'"),
    ([succeeded_pod("a1", json.dumps(RESULT)), succeeded_pod("b2", json.dumps(FORGED))], "2 different results"),
])
def test_a_malformed_result_from_the_jobs_own_pod_fails_the_step(pods, words):
    state = run(complete(), pods, needs_result=True)
    assert (state.phase, state.reason, state.retryable) == (StepPhase.FAILED, "MalformedResult", False)
    assert state.message.startswith(f"Job ml/{JOB_NAME} completed, but its result") and words in state.message
    with pytest.raises(jobs.MalformedResult):
        diagnosis.step_result(complete(), pods)


# --- the executor: observe and artifact, from the watch indexes ------------------------------------

def executor(job, pods, claims=None):
    """The kubernetes executor reading `job` and `pods` from the handlers' index view, and claims
    (name -> the claim's JSON) from a stand-in for the one GET it makes of them."""
    from kubernetes.client.exceptions import ApiException

    from ferry_operator.executors.kubernetes import KubernetesExecutor
    from ferry_operator.handlers import IndexView

    class Response:
        def __init__(self, body):
            self.data = json.dumps(body).encode()

    def read_claim(name, namespace, _preload_content=True):
        if name not in (claims or {}):
            raise ApiException(status=404)
        return Response(claims[name])

    ex = KubernetesExecutor(SETTINGS)
    ex.core.read_namespaced_persistent_volume_claim = read_claim
    name = job["metadata"]["name"] if job else JOB_NAME
    ex.view = IndexView({("ml", name): [job]} if job else {}, {("ml", name): list(pods)})
    return ex


def safetensors_mw():
    """One step (fetch), so its result is the artifact's, named like the Job above."""
    m = parse({**manifest(format={"type": "safetensors"}), "metadata": {"name": "llama", "namespace": "ml",
                                                                         "uid": "mw-uid"}})
    (step,) = prepare_steps(m.spec)
    job = make_job(manifest(format={"type": "safetensors"}))
    assert job["metadata"]["name"] == jobs.job_name(m, step)
    return m, step, job


def test_the_executor_reads_the_artifact_only_from_the_jobs_own_pod():
    m, step, job = safetensors_mw()
    job = {**job, "status": complete()["status"]}
    pods = [planted(succeeded_pod("zz", json.dumps(FORGED)), owner={**JOB_OWNER, "uid": "guessed"})]
    ex = executor(job, pods)
    assert ex.artifact(m, step) is None and ex.observe(m, step).reason == "ResultMissing"
    ex = executor(job, pods + [succeeded_pod("x7k2p", json.dumps(RESULT))])
    facts = ex.artifact(m, step)
    assert (facts.manifest_digest, facts.total_bytes) == (RESULT["manifestDigest"], RESULT["totalBytes"])
    assert facts.uri == claim_artifact_uri(m, step.digest) and ex.observe(m, step).phase == StepPhase.SUCCEEDED
    # A malformed result is a failed step, never an exception out of the reconcile.
    bad = succeeded_pod("x7k2p", '{"manifestDigest": 7}')
    ex = executor(job, [bad])
    assert ex.artifact(m, step) is None and ex.observe(m, step).reason == "MalformedResult"


def test_a_file_source_is_refused_before_any_job_is_created():
    from ferry_operator.planner import Observed, StartStep, plan

    m = parse({**with_("source", {"uri": "file:///var/run/secrets/kubernetes.io/serviceaccount"}),
               "metadata": {"name": "llama", "namespace": "ml", "generation": 1}})
    fetch = prepare_steps(m.spec)[0]
    state = executor(None, []).observe(m, fetch)
    assert (state.phase, state.reason, state.retryable) == (StepPhase.FAILED, "UnsupportedSource", False)
    assert "file:// is for the local executor only; with the kubernetes executor use pvc://, s3:// or hf://" \
        in state.message
    result = plan(m, Observed(steps={fetch.id: state}))
    assert not [a for a in result.actions if isinstance(a, StartStep)]
    assert next(c for c in result.status.conditions if c.type == "Stalled").reason == "UnsupportedSource"


# --- redaction: what a pod wrote, before it reaches conditions and Events ----------------------------

LEAKS = [
    # botocore/s3transfer with debug logging: the environment and signed headers.
    ("AWS_ACCESS_KEY_ID=AKIAIOSFODNN7EXAMPLE AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
     ["AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"]),
    ("aws_session_token = IQoJb3JpZ2luX2VjEHAaCXVzLWVhc3QtMSJHMEUCIQDx0Ab1 region=us-east-1",
     ["IQoJb3JpZ2luX2VjEHAaCXVzLWVhc3QtMSJHMEUCIQDx0Ab1"]),
    ("botocore.exceptions.ClientError: Credential=ASIAY34FZKBOKMUTVV7A/20250601/us-east-1/s3/aws4_request, "
     "SignedHeaders=host;x-amz-date, Signature=0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c4b5a69788796a5b4c3d2e1f0",
     ["ASIAY34FZKBOKMUTVV7A", "0f1e2d3c4b5a69788796a5b4c3d2e1f0"]),
    ("urllib3.exceptions.MaxRetryError: GET https://models.s3.amazonaws.com/llama/config.json?X-Amz-Credential="
     "ASIAY34FZKBOKMUTVV7A%2F20250601&X-Amz-Security-Token=FwoGZXIvYXdzEBYaDHqa0AP&X-Amz-Signature=9f8e7d",
     ["ASIAY34FZKBOKMUTVV7A", "FwoGZXIvYXdzEBYaDHqa0AP", "9f8e7d"]),
    # huggingface_hub's HTTP errors quote request headers; HF_TOKEN from an env dump.
    ("huggingface_hub.errors.HfHubHTTPError: 401 Client Error: headers={'authorization': "
     "'Bearer hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567', 'user-agent': 'huggingface_hub/0.31'}",
     ["hf_AbCdEfGhIjKlMnOpQrStUvWxYz01234567"]),
    ("HF_TOKEN=hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa98765432 python -m ferry", ["hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa98765432"]),
    ("Authorization: Basic YWRtaW46aHVudGVyMg==", ["YWRtaW46aHVudGVyMg=="]),
    ("curl -H 'Authorization: Bearer sk-live-0123456789abcdef' failed", ["sk-live-0123456789abcdef"]),
    # userinfo in an endpoint URL, and a password in a config dump.
    ("ConnectionError: HTTPConnectionPool(host='minio', port=9000): url: http://admin:hunter2@minio:9000/models",
     ["admin:hunter2", "hunter2"]),
    ('{"endpoint": "http://minio:9000", "password": "p@ss w0rd"}', ["p@ss w0rd"]),
    # A ServiceAccount token (a JWT), e.g. a worker printing its own mount.
    ("token: eyJhbGciOiJSUzI1NiIsImtpZCI6IkRFTU8ifQ.eyJpc3MiOiJrdWJlcm5ldGVzL3NlcnZpY2VhY2NvdW50In0"
     ".c2lnbmF0dXJlX2RlbW8",
     ["eyJhbGciOiJSUzI1NiIsImtpZCI6IkRFTU8ifQ"]),
    ("the secret key is wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY, check it",
     ["wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"]),
]


@pytest.mark.parametrize("leak,secrets", LEAKS, ids=[f"leak{i}" for i in range(len(LEAKS))])
def test_credentials_are_redacted_from_a_crashed_workers_log_tail(leak, secrets):
    tail = f"Traceback (most recent call last):\n  File \"/usr/local/bin/ferry\", line 8\n{leak}\n"
    states = [run(make_job(failed=1), [failed_pod("a1", 1, tail)]),  # a retried attempt
              run(make_job(active=0, failed=4, conditions=[  # the last one
                  job_condition("Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit")]),
                  [failed_pod("a1", 1, f"fetch failed: {leak}")])]
    evicted = pod(suffix="a1", phase="Failed", reason="Evicted", message=leak)  # a pod's own status message
    states.append(run(make_job(active=0, failed=1), [evicted]))
    for state in states:
        assert "[REDACTED]" in state.message, state.message
        for secret in secrets:
            assert secret not in state.message, state.message


@pytest.mark.parametrize("text", [
    HUB_404,
    "fetch failed: model-00001-of-00030.safetensors: sha256 mismatch: expected "
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    "tokenizer.json: not found in hf://meta-llama/Meta-Llama-3-70B-Instruct",
    "botocore.exceptions.NoCredentialsError: Unable to locate credentials",
    "An error occurred (InvalidAccessKeyId) when calling the GetObject operation: The AWS Access Key Id you provided "
    "does not exist in our records.",
    'secret "hf-token" not found',
])
def test_ordinary_errors_pass_unredacted(text):
    assert redact(text) == text
    assert redact(redact(LEAKS[0][0])) == redact(LEAKS[0][0])  # idempotent: the marker matches nothing


# --- 403 ----------------------------------------------------------------------------------------

def status_body(message):
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": message, "reason": "Forbidden", "details": {"group": "batch", "kind": "jobs"},
                       "code": 403})


@pytest.mark.parametrize("message,expected", [
    ('jobs.batch is forbidden: User "system:serviceaccount:ferry-system:ferry-operator" cannot create resource '
     '"jobs" in API group "batch" in the namespace "ml"',
     "the operator's ServiceAccount ferry-system/ferry-operator may not create jobs.batch in namespace ml"),
    ('storageclasses.storage.k8s.io "fast" is forbidden: User "system:serviceaccount:ferry-system:ferry-operator" '
     'cannot get resource "storageclasses" in API group "storage.k8s.io" at the cluster scope',
     "may not get storageclasses.storage.k8s.io at the cluster scope"),
    ('pods is forbidden: User "system:serviceaccount:ferry-system:ferry-operator" cannot list resource "pods" in '
     'API group "" in the namespace "ml"', "may not list pods in namespace ml"),
    ('modelweights.ferry.dev "llama" is forbidden: User "alice" cannot patch resource "modelweights/status" in API '
     'group "ferry.dev" in the namespace "ml"', "the operator's identity 'alice' may not patch modelweights.ferry.dev/status"),
])
def test_forbidden_names_who_what_and_where_to_grant_it(message, expected):
    text = diagnosis.forbidden(status_body(message))
    assert expected in text and "ClusterRole" in text


def test_a_forbidden_that_is_not_rbac_is_quoted():
    message = ('persistentvolumeclaims "llama-weights" is forbidden: exceeded quota: storage, requested: '
               "requests.storage=200Gi, used: requests.storage=0, limited: requests.storage=100Gi")
    assert diagnosis.forbidden(status_body(message)) == f"the API server refused a request of the operator: {message}"
    assert "(403)" in diagnosis.forbidden(None, "(403)\nReason: Forbidden")


# --- what a real v1.34 kubelet wrote ------------------------------------------------------------

REAL = json.loads((Path(__file__).parent / "kubelet_v1_34_jobs.json").read_text())


def owned(captured):
    """The capture, trimmed before diagnosis read ownership, with the Job's uid and its pods' controller
    reference put back from the controller-uid label the Job controller set beside them."""
    captured = copy.deepcopy(captured)
    job_meta = captured["job"]["metadata"]
    for p in captured["pods"]:
        uid = p["metadata"]["labels"]["batch.kubernetes.io/controller-uid"]
        job_meta["uid"] = uid
        p["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": job_meta["name"],
                                             "uid": uid, "controller": True, "blockOwnerDeletion": True}]
    return captured


@pytest.mark.parametrize("case,phase,reason,words", [
    ("secret", StepPhase.FAILED, "SecretNotFound", '(kubelet: secret "hf-token" not found)'),
    ("neverpull", StepPhase.FAILED, "ImageNotFound", 'image "ferry.local/nope:1" is not on node ferry-node-0'),
    # No registry reachable: not a definite answer, so the kubelet's retries get their time.
    ("pull", StepPhase.RUNNING, "ImagePullBackOff", "connect: connection refused"),
    ("invalid", StepPhase.FAILED, "InvalidImageName", "must be lowercase"),
    ("exit2", StepPhase.FAILED, "WorkerFailed", "hf://org/x: no model weights found (exit code 2); the worker "
                                                "rejected its input, so the Job did not retry"),
    ("oom", StepPhase.FAILED, "WorkerFailed", "OOMKilled, exit code 137"),
    ("exit1", StepPhase.FAILED, "WorkerFailed", "(exit code 1); all 2 attempts failed"),
])
def test_what_a_real_kubelet_reports(case, phase, reason, words):
    captured = owned(REAL["cases"][case])
    at = datetime.fromisoformat(REAL["capturedAt"].replace("Z", "+00:00"))
    state = diagnose(captured["job"], captured["pods"], {}, {}, now=at)
    assert (state.phase, state.reason) == (phase, reason)
    assert words in state.message
    later = diagnose(captured["job"], captured["pods"], {}, {}, now=at + diagnosis.IMAGE_PULL_GRACE)
    if case == "pull":
        assert (later.phase, later.reason) == (StepPhase.FAILED, "ImagePullFailed")


def test_progress_is_read_from_the_jobs_own_pods_only():
    from ferry_operator.executors.diagnosis import PROGRESS_CONDITION, reported_progress
    from ferry_worker.progress_report import CONDITION

    assert PROGRESS_CONDITION == CONDITION
    job = {"metadata": {"name": "llama-fetch-abc", "uid": "job-uid"}}

    def pod(owner_uid, message, at="2026-12-01T10:00:00Z"):
        return {"metadata": {"name": "p", "ownerReferences": [
                    {"kind": "Job", "controller": True, "uid": owner_uid, "name": "llama-fetch-abc"}]},
                "status": {"conditions": [{"type": CONDITION, "status": "Unknown", "message": message,
                                           "lastTransitionTime": at}]}}

    own = pod("job-uid", '{"step": "fetch", "bytesDone": 5}')
    planted = pod("other-uid", '{"step": "fetch", "bytesDone": 999}', at="2026-12-01T11:00:00Z")
    assert reported_progress(job, [planted, own]) == {"step": "fetch", "bytesDone": 5}
    assert reported_progress(job, [pod("job-uid", "not json")]) is None
    assert reported_progress(job, [pod("job-uid", '["a list"]')]) is None
    assert reported_progress(job, [pod("job-uid", '{"step": "' + "x" * 5000 + '"}')]) is None


def test_a_claim_ferry_would_create_that_exists_and_is_another_ones_is_never_used():
    m = parse({**manifest(), "metadata": {"name": "llama", "namespace": "ml", "uid": "mw-uid"}})
    step = prepare_steps(m.spec)[0]
    theirs = {"metadata": {"name": "llama-weights", "labels": {"team": "b"}}}
    ex = executor(None, [], claims={"llama-weights": theirs})
    state = ex.observe(m, step)
    assert (state.phase, state.reason) == (StepPhase.FAILED, "ClaimNotOwned") and not state.retryable
    assert "claim llama-weights already exists and is not this ModelWeights'" in state.message
    # A namesake's (another team's deleted ModelWeights "llama", Retain): the name is not the identity.
    namesakes = {"metadata": {"name": "llama-weights", "labels": {jobs.LABEL_MW: "llama",
                                                                  jobs.LABEL_MW_UID: "their-uid"}}}
    assert executor(None, [], claims={"llama-weights": namesakes}).observe(m, step).reason == "ClaimNotOwned"
    ours = {"metadata": {"name": "llama-weights", "labels": {jobs.LABEL_MW: "llama", jobs.LABEL_MW_UID: "mw-uid"}}}
    assert executor(None, [], claims={"llama-weights": ours}).observe(m, step).phase == StepPhase.NOT_STARTED
    assert executor(None, [], claims={}).observe(m, step).phase == StepPhase.NOT_STARTED


def test_a_job_under_the_steps_name_that_the_modelweights_does_not_own_is_never_adopted():
    m, step, job = safetensors_mw()
    planted = {**job, "status": complete()["status"],
               "metadata": {**job["metadata"], "ownerReferences": [{"kind": "ModelWeights", "controller": True,
                                                                    "uid": "someone-else"}]}}
    ex = executor(planted, [succeeded_pod("x7k2p", json.dumps(RESULT))])
    state = ex.observe(m, step)
    assert (state.phase, state.reason) == (StepPhase.FAILED, "JobNotOwned") and not state.retryable
    assert ex.artifact(m, step) is None
