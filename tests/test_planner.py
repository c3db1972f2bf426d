"""The reconcile planner, without a cluster: observed state in, actions and status out."""
from __future__ import annotations

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.planner import (
    ArtifactFacts, Observed, PatchWorkload, StartStep, StepPhase, StepState, blocked, human_bytes, plan,
)
from ferry_operator.serving.wiring import DIGEST_ANNOTATION, SERVED_NAME_ANNOTATION, WorkloadFacts
from ferry_operator.steps import prepare_steps, spec_digest
from spec_cases import manifest, with_


def mw(obj=None, generation=3):
    obj = obj or manifest()
    obj = {**obj, "metadata": {**obj["metadata"], "generation": generation}}
    return parse(obj)


def conds(p):
    return {c.type: (c.status, c.reason) for c in p.status.conditions}


def test_sharded_state_is_fetch_then_shard_with_the_spec():
    steps = prepare_steps(mw().spec)
    assert [s.name for s in steps] == ["fetch", "shard"]
    fetch, shard = steps
    assert fetch.argv[:5] == ("fetch", "--source", "{source}", "--output", "{staging}")
    assert "--revision" in fetch.argv
    assert shard.argv[shard.argv.index("--tensor-parallel-size") + 1] == "4"
    assert shard.argv[shard.argv.index("--max-part-size") + 1] == str(5 << 30)
    assert shard.argv[shard.argv.index("--output") + 1] == "{artifact}"


def test_a_new_object_starts_the_first_step_only():
    p = plan(mw(), Observed())
    assert [a.step.name for a in p.actions] == ["fetch"]
    assert conds(p)["Reconciling"] == ("True", "Fetch")
    assert conds(p)["Ready"][0] == "False"
    assert p.status.phase == "Fetching"
    assert p.status.observed_generation == 3
    assert all(c.observed_generation == 3 for c in p.status.conditions)


def test_running_step_is_not_started_twice():
    m = mw()
    fetch, shard = prepare_steps(m.spec)
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.RUNNING)}))
    assert p.actions == []
    assert p.status.phase == "Fetching"


def test_after_fetch_the_shard_step_starts():
    m = mw()
    fetch, shard = prepare_steps(m.spec)
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.SUCCEEDED)}))
    assert p.actions == [StartStep(shard)]
    assert conds(p)["Downloaded"] == ("True", "Fetched")
    assert p.status.phase == "Preparing"


FACTS = ArtifactFacts(uri="pvc://llama-weights/llama/abc", total_bytes=3 << 30, manifest_digest="sha256:" + "0" * 64)
VLLM_ARGS = ["--model", "meta-llama/Meta-Llama-3-70B-Instruct", "--max-model-len", "8192", "-tp", "2"]


def prepared(m):
    return {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}


def deployment(args=VLLM_ARGS, digest=None, rolled_out=True, containers=("vllm",), annotations=None):
    return WorkloadFacts(name="llama-70b-vllm", containers={c: list(args) for c in containers},
                           template_annotations={**({DIGEST_ANNOTATION: digest} if digest else {}),
                                                 **(annotations or {})},
                           rolled_out=rolled_out)


def test_prepared_artifact_patches_the_serving_deployment():
    m = mw()
    p = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": deployment()}))
    (action,) = p.actions
    assert isinstance(action, PatchWorkload) and action.name == "llama-70b-vllm"
    template = action.patch["spec"]["template"]
    assert template["metadata"]["annotations"][DIGEST_ANNOTATION] == FACTS.manifest_digest
    (c,) = template["spec"]["containers"]
    assert c["name"] == "vllm"
    # The user's flags stay; Ferry's replace theirs (aliases included); clients keep the model's name.
    assert c["args"] == ["--max-model-len", "8192", "--model", "/ferry/weights", "--load-format", "sharded_state",
                         "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1",
                         "--served-model-name", "meta-llama/Meta-Llama-3-70B-Instruct"]
    assert template["metadata"]["annotations"][SERVED_NAME_ANNOTATION] == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert c["volumeMounts"] == [{"name": "ferry-weights", "mountPath": "/ferry/weights", "readOnly": True,
                                  "subPath": "llama/abc"}]
    # `$retainKeys`: switching back from the node cache's CSI volume leaves one volume source.
    assert template["spec"]["volumes"] == [{"name": "ferry-weights", "$retainKeys": ["name", "persistentVolumeClaim"],
                                            "persistentVolumeClaim": {"claimName": "llama-weights", "readOnly": True}}]
    assert conds(p)["ServingUpdated"] == ("False", "RollingOut")
    assert p.status.phase == "Wiring"


def test_wired_and_rolled_out_is_ready():
    m = mw()
    first = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": deployment()}))
    args = first.actions[0].patch["spec"]["template"]["spec"]["containers"][0]["args"]
    annotations = first.actions[0].patch["spec"]["template"]["metadata"]["annotations"]
    wired = deployment(args=args, annotations=annotations)
    p = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": wired}))
    assert p.actions == []  # idempotent: nothing to patch again
    assert conds(p)["ServingUpdated"] == ("True", "RolledOut")
    assert conds(p)["Ready"] == ("True", "Ready")
    assert conds(p)["Reconciling"][0] == "False"
    assert p.status.phase == "Ready"
    assert p.status.artifact.size == "3.0Gi" and p.status.artifact.tensor_parallel_size == 4
    rolling = deployment(args=args, annotations=annotations, rolled_out=False)
    p = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": rolling}))
    assert p.actions == []
    assert conds(p)["ServingUpdated"] == ("False", "RollingOut") and conds(p)["Ready"][0] == "False"


def test_a_missing_deployment_waits_and_a_missing_container_stalls():
    m = mw()
    p = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": None}))
    assert conds(p)["ServingUpdated"] == ("False", "DeploymentNotFound") and p.actions == []
    p = plan(m, Observed(steps=prepared(m), artifact=FACTS,
                         workloads={"llama-70b-vllm": deployment(containers=("server",))}))
    assert conds(p)["Stalled"] == ("True", "ServingError")
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert "no container 'vllm'" in stalled.message and "server" in stalled.message


def test_steps_done_without_a_manifest_is_never_ready():
    m = mw()
    steps = prepare_steps(m.spec)
    p = plan(m, Observed(steps={s.id: StepState(StepPhase.SUCCEEDED) for s in steps}, artifact=None,
                         workloads={"llama-70b-vllm": deployment()}))
    assert conds(p)["Ready"][0] == "False"
    assert conds(p)["Stalled"] == ("True", "ArtifactIncomplete")


def test_a_failed_step_stalls_with_its_message():
    m = mw()
    fetch, _ = prepare_steps(m.spec)
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.FAILED, "exit code 1: no weights found")}))
    assert p.actions == []
    assert conds(p)["Stalled"] == ("True", "FetchFailed")
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert "no weights found" in stalled.message
    assert p.status.phase == "Failed"


def test_transition_time_kept_while_status_unchanged():
    m = mw()
    first = plan(m, Observed())
    m2 = m.model_copy(update={"status": first.status})
    second = plan(m2, Observed())
    t1 = {c.type: c.last_transition_time for c in first.status.conditions}
    t2 = {c.type: c.last_transition_time for c in second.status.conditions}
    assert t1 == t2


def test_spec_change_that_shapes_the_artifact_changes_the_step_ids():
    a = mw()
    assert spec_digest(a.spec) != spec_digest(mw(with_("format.tensorParallelSize", 8)).spec)
    assert spec_digest(a.spec) != spec_digest(mw(with_("source.revision", "v2")).spec)
    # Serving and deletion settings do not reshape the artifact.
    assert spec_digest(a.spec) == spec_digest(mw(with_("serving.deployments", [{"name": "other"}])).spec)
    assert spec_digest(a.spec) == spec_digest(mw(with_("deletionPolicy", "Delete")).spec)
    # Nor does the TP of a plain safetensors copy: only the serving flag changes.
    plain = with_("format", {"type": "safetensors", "tensorParallelSize": 2})
    assert spec_digest(mw(plain).spec) == spec_digest(mw(with_("format.tensorParallelSize", 8, plain)).spec)


def test_tensorizer_is_fetch_then_tensorize_into_its_own_prefix():
    from ferry_operator.locations import s3_artifact_uri

    m = mw(manifest(format={"type": "tensorizer", "tensorParallelSize": 2,
                            "tensorizer": {"encryptionSecretRef": {"name": "key"}}},
                    storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x/"}}))
    fetch, tensorize = prepare_steps(m.spec)
    assert fetch.argv[4] == "{staging}" and tensorize.name == "tensorize"
    assert tensorize.argv[:5] == ("tensorize", "--source", "{staging}", "--output", "{artifact}")
    assert tensorize.argv[tensorize.argv.index("--layout") + 1] == "vllm"
    assert tensorize.argv[tensorize.argv.index("--tensor-parallel-size") + 1] == "2"
    assert tensorize.argv[-2:] == ("--encryption-key-file", "{tensorizer_key}")
    digest = spec_digest(m.spec)
    m.metadata.namespace, m.metadata.uid = "ns", "0c1f-uid"
    assert s3_artifact_uri(m, digest) == f"s3://bucket/x/ns/llama/0c1f-uid/{digest}"
    p = plan(m, Observed())
    assert [a.step.name for a in p.actions] == ["fetch"]


def test_runai_streamer_with_storage_s3_publishes_the_safetensors():
    m = mw(manifest(format={"type": "runai_streamer"},
                    storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x"}}))
    assert [s.name for s in prepare_steps(m.spec)] == ["fetch", "publish"]


def test_runai_streamer_sharded_cuts_on_the_claim_and_publishes_the_rank_files():
    """Fetched beside the cut, both under the staging directory (removed once the artifact is recorded); the
    cut is sharded_state's, for the same shaping fields; the rank files and manifest go to storage.s3."""
    spec = {"type": "runai_streamer_sharded", "tensorParallelSize": 4, "expertParallel": True}
    m = mw(manifest(format=spec, storage={"pvc": {"size": "1Gi"}, "s3": {"uri": "s3://bucket/x"}}))
    fetch, shard, publish = prepare_steps(m.spec)
    assert fetch.argv[fetch.argv.index("--output") + 1] == "{staging}/checkpoint"
    assert shard.argv[:5] == ("shard", "--source", "{staging}/checkpoint", "--output", "{staging}/cut")
    sharded = mw(manifest(format={**spec, "type": "sharded_state"}))
    (_, same_cut) = prepare_steps(sharded.spec)
    assert shard.argv[5:] == same_cut.argv[5:] and "--expert-parallel" in shard.argv
    assert publish.argv == ("publish", "--source", "{staging}/cut", "--output", "{artifact}")
    # Its spec digest moves with the cut (TP), unlike runai_streamer's.
    tp2 = mw(manifest(format={**spec, "tensorParallelSize": 2}, storage={"pvc": {"size": "1Gi"},
                                                                           "s3": {"uri": "s3://bucket/x"}}))
    assert prepare_steps(tp2.spec)[0].digest != fetch.digest


def test_runai_streamer_from_s3_needs_no_preparation_and_streams_from_the_source():
    m = mw(manifest(source={"uri": "s3://models/qwen", "credentialsSecretRef": {"name": "s3"}}, storage=None,
                    format={"type": "runai_streamer", "runaiStreamer": {"concurrency": 32}}))
    p = plan(m, Observed(workloads={"llama-70b-vllm": deployment()}))
    (action,) = p.actions
    c = action.patch["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][c["args"].index("--model") + 1] == "s3://models/qwen"
    assert c["args"][c["args"].index("--model-loader-extra-config") + 1] == '{"concurrency": 32}'
    assert "volumeMounts" not in c
    assert {e["name"] for e in c["env"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"}
    assert action.patch["spec"]["template"]["metadata"]["annotations"][DIGEST_ANNOTATION] == "s3://models/qwen"


@pytest.mark.parametrize("n,text", [(0, "0"), (1023, "1023"), (1536, "1.5Ki"), (141 << 30, "141Gi")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


def test_ready_clears_an_earlier_stall():
    m = mw()
    steps = prepare_steps(m.spec)
    done = {s.id: StepState(StepPhase.SUCCEEDED) for s in steps}
    stalled = plan(m, Observed(steps=done, artifact=None, workloads={"llama-70b-vllm": deployment()}))
    assert conds(stalled)["Stalled"][0] == "True"
    m2 = m.model_copy(update={"status": stalled.status})
    first = plan(m2, Observed(steps=done, artifact=FACTS, workloads={"llama-70b-vllm": deployment()}))
    assert conds(first)["Stalled"][0] == "False"


def test_a_failed_step_with_a_reason_stalls_with_that_reason():
    m = mw()
    fetch, _ = prepare_steps(m.spec)
    failed = StepState(StepPhase.FAILED, 'Secret ml/hf-token (spec.source.credentialsSecretRef) does not exist',
                       reason="SecretNotFound")
    p = plan(m, Observed(steps={fetch.id: failed}))
    assert conds(p)["Stalled"] == ("True", "SecretNotFound")
    assert conds(p)["Ready"] == ("False", "SecretNotFound")
    assert conds(p)["Downloaded"] == ("False", "SecretNotFound")
    assert conds(p)["Reconciling"][0] == "False"
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert stalled.message == "fetch failed: Secret ml/hf-token (spec.source.credentialsSecretRef) does not exist"
    assert p.status.phase == "Failed" and p.actions == []
    # Fixed (the Secret created): the kubelet starts the container, the step runs, the stall ends.
    m2 = m.model_copy(update={"status": p.status})
    p2 = plan(m2, Observed(steps={fetch.id: StepState(StepPhase.RUNNING)}))
    assert conds(p2)["Stalled"] == ("False", "Progressing") and conds(p2)["Reconciling"] == ("True", "Fetch")
    assert p2.status.phase == "Fetching"


def test_a_waiting_step_says_why_in_reconciling_without_stalling():
    m = mw()
    fetch, _ = prepare_steps(m.spec)
    waiting = StepState(StepPhase.RUNNING, "pod ml/llama-fetch-x cannot be scheduled: 0/1 nodes are available",
                        reason="Unschedulable")
    p = plan(m, Observed(steps={fetch.id: waiting}))
    assert conds(p)["Reconciling"] == ("True", "Unschedulable")
    assert "Stalled" not in conds(p) and p.status.phase == "Fetching" and p.actions == []
    reconciling = next(c for c in p.status.conditions if c.type == "Reconciling")
    assert reconciling.message == "step fetch running: pod ml/llama-fetch-x cannot be scheduled: 0/1 nodes are available"


def test_blocked_stalls_and_keeps_what_was_observed():
    m = mw()
    ready = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": deployment()}))
    status = blocked(ready.status, 4, "Forbidden", "may not list pods in namespace ml")
    by_type = {c.type: c for c in status.conditions}
    assert (by_type["Stalled"].status, by_type["Stalled"].reason) == ("True", "Forbidden")
    assert by_type["Ready"].status == "False" and by_type["Reconciling"].status == "False"
    assert by_type["Prepared"].status == "True"  # as last observed
    assert status.phase == "Failed" and status.observed_generation == 4
    assert status.artifact == ready.status.artifact
    assert ready.status.phase != "Failed"  # a copy: the input is untouched


def test_the_recorded_artifact_is_the_source_of_truth_for_its_spec_only():
    from dataclasses import replace

    from ferry_operator.planner import recorded_artifact

    m = mw()
    steps = prepare_steps(m.spec)
    assert recorded_artifact(m, steps, FACTS.uri) is None  # nothing recorded yet
    ready = plan(m, Observed(steps=prepared(m), artifact=FACTS))
    assert ready.status.artifact.spec_digest == steps[-1].digest
    m.status = ready.status
    assert recorded_artifact(m, steps, FACTS.uri, FACTS) == FACTS  # with the executor's record of it
    # Without one (restarted, the Job gone): the status's facts, which act on this object's own only.
    assert recorded_artifact(m, steps, FACTS.uri) == FACTS
    assert recorded_artifact(m, steps, FACTS.uri, replace(FACTS, uri="pvc://elsewhere/x")) == FACTS
    # A record pointing anywhere but where the executor writes it is not this object's artifact.
    for elsewhere in ("file:///var/run/secrets/kubernetes.io", "pvc://other-team/llama/abc", "s3://x/y"):
        assert recorded_artifact(m, steps, elsewhere) is None
    # A spec change that shapes the bytes: the record is for another artifact.
    changed = mw(with_("format.tensorParallelSize", 8))
    changed.status = ready.status
    assert recorded_artifact(changed, prepare_steps(changed.spec), FACTS.uri) is None
    # A record without a manifest digest (an older operator's) proves nothing.
    m.status.artifact.manifest_digest = None
    assert recorded_artifact(m, steps, FACTS.uri) is None


def test_a_forged_status_artifact_changes_no_job_or_patch_ferry_renders():
    """Whoever may write the status could record any size and MoE facts for the right URI and digest:
    the size that a fill Job declares to the node agent, and the experts that decide whether the
    container's own data-parallel flags are refused, come from the executor's record only."""
    from ferry_operator.api.types import ModelWeightsStatus
    from ferry_operator.executors.cache_fill import fill_job_manifest
    from ferry_operator.executors.jobs import WorkerSettings
    from ferry_operator.planner import recorded_artifact

    steps = prepare_steps(mw().spec)
    dp = deployment(args=[*VLLM_ARGS, "--data-parallel-size", "2"])  # refused only for a pre-cut MoE artifact
    recorded = plan(mw(), Observed(steps=prepared(mw()), artifact=FACTS)).status

    def rendered(status, verified):
        m = mw({**manifest(), "metadata": {"name": "llama", "namespace": "ml", "uid": "u-1"}})
        m.status = ModelWeightsStatus.model_validate(status.model_dump())
        facts = recorded_artifact(m, steps, FACTS.uri, verified)
        p = plan(m, Observed(steps=prepared(m), artifact=facts, workloads={"llama-70b-vllm": dp}))
        fill = fill_job_manifest(m, "uid", "gpu-a", p.status.artifact, 1, WorkerSettings(image="ferry:dev"))
        return p.actions, fill, conds(p)

    forged = recorded.model_copy(deep=True)
    forged.artifact.total_bytes, forged.artifact.experts, forged.artifact.expert_parallel = 1 << 50, 256, True
    assert rendered(forged, FACTS) == rendered(recorded, FACTS)
    actions, fill, _ = rendered(forged, FACTS)
    assert isinstance(actions[0], PatchWorkload)  # not refused as a MoE artifact
    (volume,) = [v for v in fill["spec"]["template"]["spec"]["volumes"] if "csi" in v]
    assert volume["csi"]["volumeAttributes"]["bytes"] == str(FACTS.total_bytes)  # the executor's, not 1 PiB
    # No record (a new operator, the Job gone): the status's facts, forged or not. They act on this object's
    # own only: its serving flags, and a fill the node agent holds to the bytes it declares and charges to
    # this namespace (tests/worker/test_cache_fairness.py).
    m = mw()
    m.status = forged
    unverified = recorded_artifact(m, steps, FACTS.uri, None)
    assert (unverified.uri, unverified.manifest_digest) == (FACTS.uri, FACTS.manifest_digest)
    assert (unverified.total_bytes, unverified.experts, unverified.expert_parallel) == (1 << 50, 256, True)


def test_a_retryable_failure_is_retried_with_backoff_then_stalls():
    from datetime import timedelta

    from ferry_operator.planner import RetryPolicy, RetryStep

    policy = RetryPolicy(limit=2, base_s=10)
    m = mw(with_("serving", None))
    fetch, _ = prepare_steps(m.spec)
    crashed = Observed(steps={fetch.id: StepState(StepPhase.FAILED, "exit code 1: connection reset", retryable=True)})

    p = plan(m, crashed, policy)  # first sight: scheduled, not yet started
    assert p.actions == [] and conds(p)["Reconciling"] == ("True", "Retrying")
    assert conds(p).get("Stalled", ("False",))[0] == "False"
    assert p.status.retry.attempt == 0 and p.status.retry.next_attempt_at is not None
    reconciling = next(c for c in p.status.conditions if c.type == "Reconciling")
    assert "connection reset; retry 1 of 2 in 1" in reconciling.message  # 10s (or 9s a moment later)
    m.status = p.status
    assert plan(m, crashed, policy).actions == []  # still backing off

    m.status.retry.next_attempt_at -= timedelta(seconds=11)  # the back-off has passed
    p = plan(m, crashed, policy)
    assert p.actions == [RetryStep(fetch, 1)] and p.status.retry.attempt == 1
    m.status = p.status
    p = plan(m, crashed, policy)  # the retry failed too: the next one waits twice as long
    assert p.actions == [] and p.status.retry.attempt == 1
    assert 19 <= (p.status.retry.next_attempt_at - p.status.conditions[0].last_transition_time).total_seconds() <= 21
    m.status = p.status
    m.status.retry.next_attempt_at -= timedelta(seconds=21)
    p = plan(m, crashed, policy)
    assert p.actions == [RetryStep(fetch, 2)]
    m.status = p.status

    p = plan(m, crashed, policy)  # out of retries
    assert p.actions == [] and conds(p)["Stalled"] == ("True", "FetchFailed")
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert "(after 2 retries)" in stalled.message and "ferry.dev/requested-at" in stalled.message
    m.status = p.status

    # The annotation asks for a retry at once, with a fresh budget...
    p = plan(m, Observed(steps=crashed.steps, requested_at="1764583200"), policy)
    assert p.actions == [RetryStep(fetch, 1)] and p.status.last_handled_requested_at == "1764583200"
    m.status = p.status
    # ...once per new value; a success ends the retries.
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.SUCCEEDED)}, requested_at="1764583200"), policy)
    assert not any(isinstance(a, RetryStep) for a in p.actions) and p.status.retry is None


def test_a_failure_that_waits_on_a_fix_is_not_retried_but_the_annotation_retries_it():
    from ferry_operator.planner import RetryStep

    m = mw(with_("serving", None))
    fetch, _ = prepare_steps(m.spec)
    bad = Observed(steps={fetch.id: StepState(StepPhase.FAILED, "no weights under s3://x", "WorkerFailed")})
    p = plan(m, bad)
    assert p.actions == [] and conds(p)["Stalled"] == ("True", "WorkerFailed") and p.status.retry is None
    m.status = p.status
    p = plan(m, Observed(steps=bad.steps, requested_at="now"))
    assert p.actions == [RetryStep(fetch, 1)] and conds(p)["Stalled"][0] == "False"


@pytest.mark.parametrize("policy,keep,removed", [("Delete", 1, [[], [0], [1]]), ("Retain", 1, [[], [], [0]]),
                                                  ("Retain", 2, [[], [], []])])
def test_superseded_artifacts_are_removed_per_policy_once_ready(policy, keep, removed):
    from ferry_operator.planner import RemoveArtifact

    m = mw(with_("serving", None, with_("deletionPolicy", policy)))
    digests = []
    for i, tp in enumerate((2, 4, 8)):
        m.spec.format.tensor_parallel_size = tp
        digests.append(prepare_steps(m.spec)[-1].digest)
        facts = ArtifactFacts(uri=f"pvc://w/llama/{digests[-1]}/artifact", total_bytes=1,
                              manifest_digest="sha256:" + f"{i}" * 64)
        p = plan(m, Observed(steps=prepared(m), artifact=facts), keep_previous=keep)
        assert conds(p)["Ready"][0] == "True"
        assert [a.artifact.spec_digest for a in p.actions if isinstance(a, RemoveArtifact)] == \
            [digests[j] for j in removed[i]]
        kept = [a.spec_digest for a in p.status.previous_artifacts]
        assert kept == ([] if policy == "Delete" else digests[:-1][::-1][:keep])
        m.status = p.status


def test_a_superseded_artifact_stays_while_a_deployment_still_serves_it():
    from ferry_operator.planner import RemoveArtifact

    m = mw(with_("deletionPolicy", "Delete"))
    first = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-vllm": deployment()}))
    m.status = first.status
    m.status.artifact.spec_digest = "0" * 12  # the record of an earlier spec
    new = ArtifactFacts(uri="pvc://w/llama/new/artifact", total_bytes=1, manifest_digest="sha256:" + "1" * 64)
    p = plan(m, Observed(steps=prepared(m), artifact=new, workloads={"llama-vllm": deployment(rolled_out=False)}))
    assert conds(p)["Ready"][0] == "False"
    assert not any(isinstance(a, RemoveArtifact) for a in p.actions)
    assert [a.spec_digest for a in p.status.previous_artifacts] == ["0" * 12]  # listed, kept


def test_a_deployment_another_modelweights_owns_is_not_wired():
    m = mw()
    owned = deployment(annotations={"ferry.dev/modelweights": "other"})
    p = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": owned},
                         owners={"llama-70b-vllm": "other"}))
    assert p.actions == []  # neither patched nor its ServiceAccount bound
    assert conds(p)["Stalled"] == ("True", "DeploymentClaimed")
    assert conds(p)["ServingUpdated"] == ("False", "DeploymentClaimed")
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert "deployment llama-70b-vllm is wired by ModelWeights other" in stalled.message
    # Once it is this one's (the other let it go), it is wired.
    p = plan(m, Observed(steps=prepared(m), artifact=FACTS, workloads={"llama-70b-vllm": owned},
                         owners={"llama-70b-vllm": "llama"}))
    assert isinstance(p.actions[0], PatchWorkload)


def test_a_running_steps_report_becomes_status_progress_only_if_it_is_a_valid_progress():
    m = mw()
    fetch = prepare_steps(m.spec)[0]
    report = {"step": "fetch", "bytesDone": 50, "bytesTotal": 200, "bytesPerSecond": 25, "etaSeconds": 6,
              "percent": 25, "updatedAt": "2026-12-01T10:00:00Z"}
    p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.RUNNING, progress=report)}))
    assert p.status.progress.bytes_done == 50 and p.status.progress.percent == 25
    # A worker parses untrusted bytes: what it reports is checked against the CRD's type.
    for bad in ({**report, "percent": 900}, {**report, "bytesDone": -1}, {**report, "bytesTotal": 2**64},
                {**report, "status": {"artifact": {}}},
                {**report, "step": "shard"}, ["not", "a", "map"]):
        p = plan(m, Observed(steps={fetch.id: StepState(StepPhase.RUNNING, progress=bad)}))
        assert p.status.progress is None, bad
