"""serving.compiledState.mode BeforeRollout without a cluster: the planner holds a Deployment's wiring until a
warm-up Job kept the new key's compiled state (and not after it finished, kept or failed), says why it
waits, and rolls as AfterFirstReady where no Job can run; the Job is the wired template rearranged to end
once the state is kept. Shares nothing: hand-made facts and the planner (tests/node/test_compiled_on_node.py
runs the Job and the warm rollout on the real node)."""
from __future__ import annotations

import json

import pytest

from ferry_operator.executors.warm_up import NEVER_READY, WARM_UP_STEP, warm_up_facts, warm_up_job_manifest
from ferry_operator.planner import Observed, PatchWorkload, RemoveWarmUp, StepPhase, StepState, WarmUp, plan
from ferry_operator.serving import strategic
from ferry_operator.serving.compiled import HARVEST_CONTAINER, WarmUpFacts
from ferry_operator.serving.loader import LOADER_CONTAINER, LoaderSettings
from ferry_operator.steps import prepare_steps
from test_serving_compiled import FACTS, LOADER, NAME, deployment, mw, wired_with

TEMPLATE = {"metadata": {"labels": {"app": NAME, "team": "a"}, "annotations": {"sidecar.istio.io/inject": "false"}},
            "spec": {"serviceAccountName": "serving", "nodeSelector": {"gpu": "h100"},
                     "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "args": ["--model", "m"],
                                     "resources": {"requests": {"nvidia.com/gpu": "1"}}},
                                    {"name": "metrics", "image": "exporter:1"}]}}


def planned(m, warm_ups, current=None):
    steps = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}
    return plan(m, Observed(steps=steps, artifact=FACTS, workloads={NAME: current or deployment()},
                            warm_ups=warm_ups), loader=LOADER)


def status_of(p):
    return json.loads(p.status.model_dump_json(by_alias=True, exclude_none=True))


def test_the_wiring_waits_for_the_warm_up_job_and_follows_it():
    m = mw("BeforeRollout")
    first = planned(m, {})
    (warm,) = first.actions
    assert isinstance(warm, WarmUp) and warm.name == NAME
    loader = next(c for c in warm.patch["spec"]["template"]["spec"]["initContainers"]
                  if c["name"] == LOADER_CONTAINER)
    assert warm.key == loader["args"][loader["args"].index("--compiled-key") + 1]
    assert any("waits: a warm-up Job keeps the compiled state" in c.message for c in first.status.conditions)
    # Running: nothing is patched, and a pod the scheduler cannot place is named with the way out.
    pending = {"status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                          "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}
    unscheduled = warm_up_facts(job(key=warm.key), [pending])
    running = planned(m, {warm.key: unscheduled})
    assert running.actions == []
    words = " ".join(c.message for c in running.status.conditions)
    assert f"waits for warm-up Job {unscheduled.job}; its pod is not scheduled" in words
    assert "Insufficient nvidia.com/gpu" in words and "free room for one more pod" in words
    assert "serving.compiledState.mode: AfterFirstReady" in words
    # Kept: the wiring goes out in the same pass, and the status remembers the key past the Job's TTL.
    done = planned(m, {warm.key: WarmUpFacts(warm.key, "llama-warm-1", "Succeeded")})
    (patch,) = done.actions
    assert isinstance(patch, PatchWorkload) and patch.patch == warm.patch
    assert done.status.compiled_state.warmed == [warm.key]
    again = planned(mw("BeforeRollout", status=status_of(done)), {})
    assert [type(a) for a in again.actions] == [PatchWorkload]  # no second Job for a key kept before


def test_a_failed_warm_up_does_not_hold_the_rollout_and_the_status_says_so():
    m = mw("BeforeRollout")
    (warm,) = planned(m, {}).actions
    failed = WarmUpFacts(warm.key, "llama-warm-1", "Failed", "compiled state absent: vLLM compiled nothing")
    rolled = planned(m, {warm.key: failed})
    assert [type(a) for a in rolled.actions] == [PatchWorkload]
    current = wired_with(m.spec, deployment())
    after = planned(mw("BeforeRollout", status=status_of(rolled)), {warm.key: failed}, current)
    assert after.actions == []
    message = after.status.compiled_state.message
    assert "warm-up Job llama-warm-1 failed (compiled state absent" in message and "first Ready pod" in message


@pytest.mark.parametrize("mode, warm_ups, host_ports", [
    ("AfterFirstReady", {}, False), ("BeforeRollout", None, False), ("BeforeRollout", {}, True)])
def test_without_before_rollout_or_jobs_the_wiring_goes_at_once(mode, warm_ups, host_ports):
    """AfterFirstReady never warms up; an executor that runs no Jobs (the local one) rolls as AfterFirstReady;
    so do pods that bind node ports (a warm-up pod beside a replica would answer on the replica's port)."""
    current = deployment(host_ports=host_ports)
    assert [type(a) for a in planned(mw(mode), warm_ups, current).actions] == [PatchWorkload]


def test_a_rewiring_that_keeps_the_key_is_not_warmed_up():
    """A new loader image (an operator upgrade) rewires every Deployment: their key, and state, stay."""
    m = mw("BeforeRollout")
    current = wired_with(m.spec, deployment())
    steps = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}
    upgraded = plan(m, Observed(steps=steps, artifact=FACTS, workloads={NAME: current}, warm_ups={}),
                    loader=LoaderSettings(image="ferry.local/ferry:2"))
    assert [type(a) for a in upgraded.actions] == [PatchWorkload]


def test_a_warm_up_no_one_waits_for_goes():
    """The user changed the template again (or turned BeforeRollout off) while a Job warmed the last one: that
    Job's pod, and what it holds, goes; a finished Job is left to its TTL."""
    m = mw("BeforeRollout")
    (warm,) = planned(m, {}).actions
    old = {"0" * 32: WarmUpFacts("0" * 32, "llama-warm-old", "Running"),
           "1" * 32: WarmUpFacts("1" * 32, "llama-warm-done", "Succeeded")}
    actions = planned(m, {**old, warm.key: WarmUpFacts(warm.key, "llama-warm-new", "Running")}).actions
    assert actions == [RemoveWarmUp("llama-warm-old")]
    off = planned(mw("AfterFirstReady"), old).actions
    assert RemoveWarmUp("llama-warm-old") in off and [type(a) for a in off] == [PatchWorkload, RemoveWarmUp]


def test_a_warm_up_goes_while_a_new_artifact_is_prepared():
    """The weights spec changed while a Job warmed the last artifact's template: every key will hash the new
    artifact, so no one waits for that Job; it goes at once, not at its one-hour deadline."""
    m = mw("BeforeRollout")
    (warm,) = planned(m, {}).actions
    running = {warm.key: WarmUpFacts(warm.key, "llama-warm-1", "Running")}
    steps = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}
    steps[next(iter(steps))] = StepState(StepPhase.RUNNING)
    preparing = plan(m, Observed(steps=steps, artifact=None, workloads={NAME: deployment()}, warm_ups=running),
                     loader=LOADER)
    assert RemoveWarmUp("llama-warm-1") in preparing.actions
    assert not any(isinstance(a, (PatchWorkload, WarmUp)) for a in preparing.actions)


def wired_template():
    (warm,) = planned(mw("BeforeRollout"), {}).actions
    return warm, strategic.apply(TEMPLATE, warm.patch["spec"]["template"])


def test_the_job_is_the_wired_template_ending_once_the_state_is_kept():
    m = mw("BeforeRollout")
    warm, template = wired_template()
    job = warm_up_job_manifest(m, "0b7e", warm.key, template, {"app": NAME})
    pod = job["spec"]["template"]["spec"]
    # vLLM and every other container of the template run as native sidecars after the loader; the harvest,
    # told to exit, is the one container whose end ends the pod.
    assert [(c["name"], c.get("restartPolicy")) for c in pod["initContainers"]] == [
        (LOADER_CONTAINER, None), ("vllm", "Always"), ("metrics", "Always")]
    (harvest,) = pod["containers"]
    assert harvest["name"] == HARVEST_CONTAINER and harvest["args"][-1] == "--once"
    assert "restartPolicy" not in harvest and harvest["terminationMessagePolicy"] == "FallbackToLogsOnError"
    vllm = pod["initContainers"][1]
    assert vllm["resources"] == {"requests": {"nvidia.com/gpu": "1"}}
    assert {"name": "VLLM_CACHE_ROOT", "value": "/ferry/compiled"} in vllm["env"]
    # Where the replicas go, as whom: kept. Serving: never (no gate, no label a Service or the Deployment
    # selects, not the annotation that makes a pod one of the object's serving pods).
    assert pod["serviceAccountName"] == "serving" and pod["nodeSelector"] == {"gpu": "h100"}
    assert pod["restartPolicy"] == "Never" and pod["readinessGates"] == [{"conditionType": NEVER_READY}]
    # The template's labels but those the Deployment selects by (its Services, autoscaler and budget do not
    # count it), its annotations but the owner annotation that would count it among the serving pods.
    meta = job["spec"]["template"]["metadata"]
    assert meta["labels"] == {"team": "a", "ferry.dev/modelweights": "llama", "ferry.dev/step": WARM_UP_STEP,
                              "ferry.dev/compiled-key": warm.key}
    assert "ferry.dev/modelweights" in template["metadata"]["annotations"]
    assert meta["annotations"] == {k: v for k, v in template["metadata"]["annotations"].items()
                                   if k != "ferry.dev/modelweights"}
    assert meta["annotations"]["sidecar.istio.io/inject"] == "false"
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] > 0
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    assert job["metadata"]["ownerReferences"][0]["uid"] == "0b7e"
    assert TEMPLATE["spec"]["containers"][0].get("restartPolicy") is None  # the input is not changed


def test_a_template_without_the_harvest_sidecar_is_refused():
    with pytest.raises(ValueError, match=HARVEST_CONTAINER):
        warm_up_job_manifest(mw("BeforeRollout"), "0b7e", "k" * 32, TEMPLATE, {"app": NAME})


def job(conditions=(), key="abc"):
    return {"metadata": {"name": "llama-warm-abc", "labels": {"ferry.dev/compiled-key": key}},
            "status": {"conditions": [{"type": t, "status": "True", "message": m} for t, m in conditions]}}


def test_what_a_warm_up_job_says():
    assert warm_up_facts(job([("Complete", "")]), []) == WarmUpFacts("abc", "llama-warm-abc", "Succeeded")
    harvest = {"status": {"containerStatuses": [{"name": HARVEST_CONTAINER, "state": {"terminated": {
        "exitCode": 1, "message": "compiled state absent: vLLM compiled nothing"}}}]}}
    failed = warm_up_facts(job([("Failed", "BackoffLimitExceeded")]), [harvest])
    assert failed.phase == "Failed" and failed.message == "compiled state absent: vLLM compiled nothing"
    assert warm_up_facts(job([("Failed", "DeadlineExceeded")]), []).message == "DeadlineExceeded"
    pending = {"status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                          "message": "0/1 nodes are available: 1 Insufficient cpu."}]}}
    running = warm_up_facts(job(), [pending])
    assert running.phase == "Running" and "not scheduled (Unschedulable: 0/1 nodes" in running.message
    crashing = {"status": {"initContainerStatuses": [{"name": "vllm", "restartCount": 4, "state": {
        "waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}}}]}}
    assert "container vllm waits: CrashLoopBackOff (restarted 4 times)" in warm_up_facts(job(), [crashing]).message
    queued = {**job(), "spec": {"suspend": True}}
    assert "suspended" in warm_up_facts(queued, []).message


def refusing_executor(status: int, message: str):
    """The kubernetes executor over a Deployment as planned, whose create of the warm-up Job the API server
    answers with `status` and `message` (a stand-in for the two calls; the handlers' index holds no Job)."""
    from ferry_operator.executors import jobs
    from ferry_operator.executors.kubernetes import KubernetesExecutor
    from ferry_operator.handlers import IndexView

    class Response:
        data = json.dumps({"metadata": {"name": NAME, "resourceVersion": "7"},
                           "spec": {"selector": {"matchLabels": {"app": NAME}}, "template": TEMPLATE}}).encode()

    def create(namespace, body):
        _refusal(status, message)

    ex = KubernetesExecutor(jobs.WorkerSettings(image=LOADER.image))
    ex.apps.read_namespaced_deployment = lambda name, namespace, _preload_content=True: Response()
    ex.batch.create_namespaced_job = create
    ex.view = IndexView({}, {})
    return ex


def _refusal(status, message):
    from kubernetes.client.exceptions import ApiException

    error = ApiException(status=status, reason="refused")
    error.body = json.dumps({"kind": "Status", "message": message})
    raise error


QUOTA = ('jobs.batch "llama-warm-1" is forbidden: exceeded quota: no-jobs, requested: count/jobs.batch=1, '
         'used: count/jobs.batch=0, limited: count/jobs.batch=0')
RBAC = ('jobs.batch is forbidden: User "system:serviceaccount:ferry-system:ferry" cannot create resource "jobs" '
        'in API group "batch" in the namespace "ml"')


def test_a_warm_up_job_the_api_server_refuses_is_a_failed_warm_up_and_the_rollout_goes_on():
    """A quota or a webhook refusing the Job must not hold the rollout (nor stall the object): it counts as a
    failed warm-up, quoted in the status. A permission the operator lacks (RBAC) and an outage still raise."""
    from kubernetes.client.exceptions import ApiException

    m = mw("BeforeRollout")
    (warm,) = planned(m, {}).actions
    ex = refusing_executor(403, QUOTA)
    ex.warm_up(m, "0b7e", warm.name, warm.patch, warm.key, "7")
    refused = ex.warm_ups(m)[warm.key]
    assert refused.phase == "Failed" and refused.message.startswith("the API server refused to create it: ")
    rolled = planned(m, ex.warm_ups(m))
    assert [type(a) for a in rolled.actions] == [PatchWorkload]
    after = planned(mw("BeforeRollout", status=status_of(rolled)), ex.warm_ups(m), wired_with(m.spec, deployment()))
    assert "refused to create it" in after.status.compiled_state.message
    assert "exceeded quota: no-jobs" in after.status.compiled_state.message
    other = m.model_copy(update={"metadata": m.metadata.model_copy(update={"uid": "another"})})
    assert ex.warm_ups(other) == {}  # another object's (a recreated one's) refusal is not this one's
    for status, message in ((403, RBAC), (500, "etcdserver: request timed out")):
        with pytest.raises(ApiException):
            refusing_executor(status, message).warm_up(m, "0b7e", warm.name, warm.patch, warm.key, "7")


def test_a_warm_up_job_that_makes_no_pod_is_named_with_the_way_to_see_why():
    from datetime import datetime, timedelta, timezone

    now = datetime(2026, 12, 5, 15, 0, tzinfo=timezone.utc)
    created = {**job(), "metadata": {**job()["metadata"], "namespace": "ml",
                                     "creationTimestamp": (now - timedelta(seconds=45)).isoformat()}}
    said = warm_up_facts(created, [], now).message
    assert "made no pod in 30 s" in said and "kubectl describe job llama-warm-abc -n ml" in said
    assert warm_up_facts(created, [], now - timedelta(seconds=30)).message == ""  # within the grace
    assert warm_up_facts(created, [], None).message == ""  # pods unknown (no index): nothing said


def test_a_job_squatting_the_warm_ups_name_does_not_hold_the_rollout():
    """Someone who may create Jobs made one under the warm-up's name first: Ferry never waits for it (it
    would never finish as Ferry's), so the rollout goes on and the status names the Job. A Job of this
    object's own under that name (an earlier reconcile's) is followed as it is."""
    from kubernetes.client.exceptions import ApiException

    m = mw("BeforeRollout")
    (warm,) = planned(m, {}).actions
    squatter = {"metadata": {"ownerReferences": [{"controller": True, "uid": "someone"}]}}
    ex = refusing_executor(409, "already exists")
    ex.batch.read_namespaced_job = lambda name, namespace, _preload_content=True: _json(squatter)
    ex.warm_up(m, "0b7e", warm.name, warm.patch, warm.key, "7")
    refused = ex.warm_ups(m)[warm.key]
    assert refused.phase == "Failed" and f"Job {refused.job} exists and is not this ModelWeights'" in refused.message
    assert refused.job.startswith("llama-warm-")
    assert [type(a) for a in planned(m, ex.warm_ups(m)).actions] == [PatchWorkload]
    ours = {"metadata": {"ownerReferences": [{"controller": True, "uid": m.metadata.uid}]}}
    going = {"metadata": {**squatter["metadata"], "deletionTimestamp": "2026-12-06T12:00:00Z"}}
    for found in (ours, going):  # ours is followed (the view, empty here, shows it); one going makes way
        ex = refusing_executor(409, "already exists")
        ex.batch.read_namespaced_job = lambda name, namespace, _preload_content=True, found=found: _json(found)
        ex.warm_up(m, "0b7e", warm.name, warm.patch, warm.key, "7")
        assert ex.warm_ups(m) == {}
    with pytest.raises(ApiException):
        refusing_executor(500, "etcdserver: request timed out").warm_up(m, "0b7e", warm.name, warm.patch,
                                                                          warm.key, "7")


def _json(body):
    class Response:
        data = json.dumps(body).encode()
    return Response()
