"""Serving pods' failures reach the ModelWeights: each kind of pod status the
kubelet and the scheduler write (shapes as the API serves them) becomes a
reason and a message naming the pod, its Deployment and the cause; those a
human must fix stall, those that may pass show in Reconciling, with an Event.
(On the real node: tests/node/test_serving_failures_on_node.py.)"""
from __future__ import annotations

from dataclasses import replace

import pytest

from ferry_operator.events import transitions
from ferry_operator.planner import ArtifactFacts, Observed, StepPhase, StepState, plan
from ferry_operator.serving.wiring import deployment_facts
from ferry_operator.serving.diagnosis import pod_trouble, workload_of
from ferry_operator.steps import prepare_steps
from ferry_operator.serving.weights_loaded import pod_facts

from test_serving_loader import DIGEST, FACTS, LOADER, NAME, applied, conds, deployment, mw, observed


def pod(*, containers=(), init=(), conditions=(), phase="Pending", name=f"{NAME}-7d9f-abcde", digest=DIGEST,
        spec_containers=None) -> dict:
    return {
        "metadata": {"name": name, "namespace": "models", "labels": {"pod-template-hash": "7d9f"},
                     "annotations": {"ferry.dev/artifact-digest": digest, "ferry.dev/modelweights": "llama"},
                     "ownerReferences": [{"kind": "ReplicaSet", "name": f"{NAME}-7d9f", "controller": True}]},
        "spec": {"nodeName": "node-1", "containers": spec_containers or [
            {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
             "readinessProbe": {"httpGet": {"path": "/health", "port": 8080}}}],
                 "initContainers": [{"name": "ferry-loader", "image": "ferry.local/ferry:dev"}]},
        "status": {"phase": phase, "conditions": list(conditions), "containerStatuses": list(containers),
                   "initContainerStatuses": list(init)},
    }


def waiting(reason: str, message: str = "", name: str = "vllm", image: str = "vllm/vllm-openai:v0.32.0") -> dict:
    return {"name": name, "image": image, "ready": False, "restartCount": 0,
            "state": {"waiting": {"reason": reason, "message": message}}}


VLLM_ERROR = ("Traceback (most recent call last):\n  File \"/usr/bin/vllm\", line 8\n"
              "ValueError: Unrecognized load format 'shardedstate' (choose from auto, sharded_state, ...)\n")


def test_the_deployment_is_read_from_the_replicaset_and_the_template_hash():
    assert workload_of(pod()) == NAME
    orphan = pod()
    orphan["metadata"]["ownerReferences"] = []
    assert workload_of(orphan) == ""


def test_statefulset_and_leaderworkerset_pods_are_filed_under_their_workload():
    sts = pod()
    sts["metadata"]["ownerReferences"] = [{"kind": "StatefulSet", "name": "llama", "controller": True}]
    assert workload_of(sts) == "statefulset/llama"
    # An LWS worker pod is owned by its group's worker StatefulSet (llama-0); LWS labels every pod with its name.
    worker = pod()
    worker["metadata"]["ownerReferences"] = [{"kind": "StatefulSet", "name": "llama-0", "controller": True}]
    worker["metadata"]["labels"] = {"leaderworkerset.sigs.k8s.io/name": "llama"}
    assert workload_of(worker) == "leaderworkerset/llama"
    worker["status"]["containerStatuses"] = [waiting("ErrImageNeverPull", "not present with pull policy of Never")]
    trouble = pod_trouble(worker)
    assert "(leaderworkerset llama)" in trouble.message and "in leaderworkerset llama" in trouble.message


@pytest.mark.parametrize("status, reason, stalls, words", [
    (waiting("ErrImageNeverPull", 'Container image "vllm/vllm-openai:v0.32.0" is not present with pull policy of '
                                  'Never'), "ImageNotFound", True, ["not on node node-1", "pull policy is Never"]),
    (waiting("InvalidImageName", 'couldn\'t parse image name "vllm:::bad"'), "InvalidImageName", True,
     ["not a valid image reference"]),
    (waiting("ErrImagePull", "rpc error: code = NotFound desc = failed to pull and unpack image: not found"),
     "ImageNotFound", True, ["cannot be pulled", "imagePullSecrets"]),
    (waiting("ImagePullBackOff", "Back-off pulling image: dial tcp 10.0.0.1:443: i/o timeout"), "ImagePullBackOff",
     False, ["the kubelet retries", "i/o timeout"]),
    (waiting("CreateContainerConfigError", 'secret "hf-token" not found'), "ContainerConfigError", True,
     ["Secret hf-token", "does not exist"]),
    ({"name": "vllm", "ready": False, "restartCount": 4,
      "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 1m20s restarting failed container"}},
      "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": VLLM_ERROR}}},
     "CrashLoopBackOff", True, ["restarted 4 times", "exit code 1", "Unrecognized load format 'shardedstate'",
                                "kubectl logs -n models"]),
    ({"name": "vllm", "ready": False, "restartCount": 2,
      "state": {"waiting": {"reason": "CrashLoopBackOff"}},
      "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}},
     "OOMKilled", True, ["ran out of memory", "resources.limits.memory"]),
])
def test_container_problems_name_the_pod_deployment_and_cause(status, reason, stalls, words):
    trouble = pod_trouble(pod(containers=[status]))
    assert (trouble.reason, trouble.stalls) == (reason, stalls), trouble
    assert f"pod models/{NAME}-7d9f-abcde (deployment {NAME})" in trouble.message
    assert all(w in trouble.message for w in words), trouble.message


def test_the_loaders_image_is_diagnosed_too():
    trouble = pod_trouble(pod(init=[waiting("ErrImageNeverPull", "not present", name="ferry-loader",
                                            image="ferry.local/ferry:dev")]))
    assert trouble.reason == "ImageNotFound" and "container ferry-loader" in trouble.message
    assert 'image "ferry.local/ferry:dev"' in trouble.message


def test_unschedulable_and_not_ready_may_pass():
    unscheduled = pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                   "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}])
    trouble = pod_trouble(unscheduled)
    assert (trouble.reason, trouble.stalls) == ("Unschedulable", False)
    assert "Insufficient nvidia.com/gpu" in trouble.message
    starting = pod(phase="Running", containers=[{"name": "vllm", "ready": False, "restartCount": 0,
                                                 "state": {"running": {"startedAt": "2026-12-02T00:00:00Z"}}}])
    trouble = pod_trouble(starting)
    assert (trouble.reason, trouble.stalls) == ("ContainerNotReady", False)
    assert "GET /health on port 8080" in trouble.message
    serving = pod(phase="Running", containers=[{"name": "vllm", "ready": True, "state": {"running": {}}}])
    assert pod_trouble(serving) is None


def test_a_token_in_what_the_pod_said_is_redacted():
    status = {"name": "vllm", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
              "lastState": {"terminated": {"exitCode": 1, "message": "error: HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz123456 "
                                                                     "rejected"}}}
    assert "hf_abcdefghijklmnopqrstuvwxyz123456" not in pod_trouble(pod(containers=[status])).message


def _wired():
    m = mw()
    current = deployment()
    wired = applied(current, plan(m, observed(m, current), loader=LOADER).actions[0].patch)
    return m, replace(wired, rolled_out=False)


def test_a_crash_looping_serving_pod_stalls_the_modelweights_with_vllms_words():
    m, wired = _wired()
    crashing = pod_facts(pod(phase="Running", init=[{"name": "ferry-loader", "state": {"terminated": {"exitCode": 0}}}],
                             containers=[{"name": "vllm", "restartCount": 3,
                                          "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                          "lastState": {"terminated": {"exitCode": 1, "message": VLLM_ERROR}}}]))
    loaded = replace(crashing, gate="True", reason="Loaded")
    p = plan(m, observed(m, wired, [loaded]), loader=LOADER)
    stalled = conds(p)["Stalled"]
    assert stalled[:2] == ("True", "CrashLoopBackOff")
    assert f"deployment {NAME} rolling out" in stalled[2] and f"pod models/{loaded.name}" in stalled[2]
    assert "Unrecognized load format 'shardedstate'" in stalled[2]
    assert conds(p)["Ready"][:2] == ("False", "CrashLoopBackOff")
    (event,) = [e for e in transitions(None, p.status, p.actions) if e.type == "Warning"]
    assert event.reason == "CrashLoopBackOff" and "Unrecognized load format" in event.message
    # Fixed (a new pod that serves): the stall ends by itself.
    fine = replace(loaded, trouble=None)
    stalled_mw = m.model_copy(update={"status": p.status})
    both = [fine, replace(fine, name=fine.name + "2")]  # the Deployment's two replicas
    again = plan(stalled_mw, observed(m, replace(wired, rolled_out=True), both), loader=LOADER)
    assert conds(again)["Stalled"][0] == "False" and conds(again)["Ready"][:2] == ("True", "Ready")


def test_a_waiting_cause_shows_in_reconciling_with_one_event_and_old_pods_do_not_count():
    m, wired = _wired()
    pending = pod_facts(pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}]))
    p = plan(m, observed(m, wired, [pending]), loader=LOADER)
    assert conds(p)["Reconciling"][:2] == ("True", "Unschedulable")
    assert "Insufficient nvidia.com/gpu" in conds(p)["Reconciling"][2] and "Stalled" not in conds(p)
    events = [e for e in transitions(None, p.status, p.actions) if e.reason == "Unschedulable"]
    assert len(events) == 1 and events[0].type == "Warning"
    # The same cause on the next reconcile posts nothing new.
    assert not [e for e in transitions(p.status, plan(m, observed(m, wired, [pending]), loader=LOADER).status, [])
                if e.reason == "Unschedulable"]
    # A pod of the previous artifact (another digest) is on its way out: not a reason to stall.
    old = pod_facts(pod(digest="sha256:" + "9" * 64, containers=[waiting("ErrImageNeverPull", "not present")]))
    p = plan(m, observed(m, wired, [old]), loader=LOADER)
    assert conds(p)["Reconciling"][:2] == ("True", "WeightsLoading") or conds(p)["Reconciling"][1] == "RollingOut"
    assert "Stalled" not in conds(p) or conds(p)["Stalled"][0] == "False"


def test_the_wired_container_keeps_its_log_tail_as_termination_message():
    m = mw()
    (action,) = plan(m, observed(m, deployment()), loader=LOADER).actions
    (container,) = action.patch["spec"]["template"]["spec"]["containers"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


@pytest.mark.parametrize("log", [
    VLLM_ERROR + "INFO 12-02 08:00:01 [launcher.py:80] Shutting down FastAPI HTTP server.\n",
    # stdout and stderr reach the log through two pipes: an info line written before the error may land after it.
    VLLM_ERROR + "vllm serve /ferry/weights --load-format sharded_state\n",
], ids=["shutdown-lines-after", "stdout-after-stderr"])
def test_the_quoted_line_is_the_error_not_the_last_line(log):
    from ferry_operator.kubelet_words import error_line

    assert error_line(log).startswith("ValueError: Unrecognized load format 'shardedstate'")
    assert error_line("all good\nstill good\n") == "still good"
