"""Serving targets beyond Deployments (issue 18): StatefulSets and LeaderWorkerSets, groups of pods that
serve one TP x PP group together, each pod loading its own slice of the ranks. The API rules, the facts
read from each kind, the wiring of a group's templates, the planner's patches, and the local strategic
merge a LeaderWorkerSet's templates get (checked against the real API server's in
test_serving_patch_apiserver.py)."""
from __future__ import annotations

import pytest

from ferry_operator.serving import strategic
from ferry_operator.api.types import Artifact, ServingTarget
from ferry_operator.api.validation import InvalidSpec, parse
from ferry_operator.planner import ArtifactFacts, Observed, PatchWorkload, StepPhase, StepState, plan
from ferry_operator.serving.wiring import GROUP_INDEX_ENV, ServingError, template_facts, template_patch
from ferry_operator.serving.loader import LoaderSettings
from ferry_operator.steps import prepare_steps
from ferry_operator.serving.workloads import GroupSizeMismatch, groups_of, leaderworkerset_facts, statefulset_facts

from spec_cases import manifest

DIGEST = "sha256:" + "7" * 64
LOADER = LoaderSettings(image="ferry.local/ferry:dev")
PP2 = {"type": "sharded_state", "tensorParallelSize": 2, "pipelineParallelSize": 2, "vllmVersion": "0.32"}
ARTIFACT = Artifact(uri="pvc://weights/llama/abc", format="sharded_state", tensor_parallel_size=2,
                    pipeline_parallel_size=2, manifest_digest=DIGEST)


def spec_with(targets: list[dict], fmt: dict = PP2):
    return parse(manifest(format=fmt, serving={"targets": targets})).spec


def vllm_template(args: list[str]) -> dict:
    return {"metadata": {"labels": {"app": "llama"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "command": ["vllm", "serve"],
                                     "args": args}]}}


def lws(size: int = 2, replicas: int = 1, leader: bool = True, status: dict | None = None) -> dict:
    lwt = {"size": size, "workerTemplate": vllm_template(["meta-llama/Llama-3.1-405B", "--headless"])}
    if leader:
        lwt["leaderTemplate"] = vllm_template(["meta-llama/Llama-3.1-405B", "--max-model-len", "8192"])
    return {"metadata": {"name": "llama", "resourceVersion": "41"},
            "spec": {"replicas": replicas, "leaderWorkerTemplate": lwt}, "status": status or {}}


# --- the API -------------------------------------------------------------------


def test_a_group_size_that_does_not_divide_the_world_is_refused_naming_the_field():
    with pytest.raises(InvalidSpec) as err:
        spec_with([{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 3}])
    assert "spec.serving.targets" in str(err.value) and "groupSize must divide" in str(err.value)
    spec = spec_with([{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}])
    (target,) = spec.serving.workloads()
    assert (target.key, target.pods_per_group, target.describe()) == ("leaderworkerset/llama", 2,
                                                                      "leaderworkerset llama")


def test_a_deployment_cannot_be_a_group_and_cannot_be_listed_twice():
    with pytest.raises(InvalidSpec) as err:
        spec_with([{"name": "llama", "groupSize": 2}])
    assert "groupSize must be 1" in str(err.value)
    with pytest.raises(InvalidSpec) as err:
        parse(manifest(format=PP2, serving={"deployments": [{"name": "llama"}],
                                            "targets": [{"kind": "Deployment", "name": "llama"}]}))
    assert "list it once" in str(err.value)
    # The same name under another kind is another workload.
    spec = parse(manifest(format=PP2, serving={"deployments": [{"name": "llama"}],
                                               "targets": [{"kind": "StatefulSet", "name": "llama"}]})).spec
    assert [t.key for t in spec.serving.workloads()] == ["llama", "statefulset/llama"]


# --- facts ---------------------------------------------------------------------


def test_a_leaderworkerset_is_read_as_its_two_templates_and_its_groups():
    facts = leaderworkerset_facts(lws(size=2, replicas=3))
    assert (facts.kind, facts.group_size, facts.groups, facts.replicas) == ("LeaderWorkerSet", 2, 3, 6)
    assert facts.containers["vllm"][-1] == "--headless" and facts.leader.containers["vllm"][-1] == "8192"
    assert not facts.rolled_out
    done = leaderworkerset_facts(lws(replicas=3, status={"replicas": 3, "readyReplicas": 3, "updatedReplicas": 3}))
    assert done.rolled_out
    updating = leaderworkerset_facts(lws(replicas=3, status={
        "replicas": 3, "readyReplicas": 3, "updatedReplicas": 3,
        "conditions": [{"type": "UpdateInProgress", "status": "True"}]}))
    assert not updating.rolled_out


def test_a_statefulset_is_rolled_out_only_on_its_update_revision():
    body = {"metadata": {"name": "llama", "generation": 2},
            "spec": {"replicas": 2, "serviceName": "llama", "template": vllm_template(["m"])},
            "status": {"observedGeneration": 2, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                       "currentRevision": "llama-a", "updateRevision": "llama-b"}}
    assert not statefulset_facts(body).rolled_out
    body["status"]["currentRevision"] = "llama-b"
    facts = statefulset_facts(body)
    assert facts.rolled_out and (facts.group_size, facts.service_name) == (2, "llama")


def test_groups_need_the_declared_size_a_leader_template_and_a_service():
    target = ServingTarget(kind="LeaderWorkerSet", name="llama", group_size=2)
    with pytest.raises(GroupSizeMismatch) as err:
        groups_of(target, leaderworkerset_facts(lws(size=4)))
    assert "groups of 4 pods (leaderWorkerTemplate.size)" in str(err.value) and "groupSize 2" in str(err.value)
    with pytest.raises(ServingError, match="no leaderTemplate"):
        groups_of(target, leaderworkerset_facts(lws(leader=False)))
    workers, leader = groups_of(target, leaderworkerset_facts(lws()))
    assert workers.headless and not leader.headless and leader.master_addr == "$(LWS_LEADER_ADDRESS)"
    sts = ServingTarget(kind="StatefulSet", name="llama", group_size=2)
    body = {"metadata": {"name": "llama"}, "spec": {"replicas": 2, "template": vllm_template(["m"])}}
    with pytest.raises(ServingError, match="no serviceName"):
        groups_of(sts, statefulset_facts(body))
    body["spec"]["serviceName"] = "llama-hl"
    group, none = groups_of(sts, statefulset_facts(body))
    assert none is None and group.master_addr == "llama-0.llama-hl"
    assert group.index_label == "apps.kubernetes.io/pod-index"
    # groupSize 1 (the default): every pod serves the whole group, nothing group-wise is wired.
    assert groups_of(ServingTarget(kind="LeaderWorkerSet", name="llama"), leaderworkerset_facts(lws())) == (None, None)


# --- wiring a group's templates ------------------------------------------------------


def container(patch: dict, name: str) -> dict:
    spec = patch["spec"]["template"]["spec"]
    return next(c for c in [*spec["containers"], *spec.get("initContainers", [])] if c["name"] == name)


def test_each_pod_of_a_group_loads_its_slice_and_runs_vllms_multi_node_launch():
    spec = spec_with([{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}])
    facts = leaderworkerset_facts(lws())
    workers, leader = groups_of(spec.serving.targets[0], facts)
    worker_patch = template_patch(spec, "llama", ARTIFACT, "vllm", facts, LOADER, workers)
    leader_patch = template_patch(spec, "llama", ARTIFACT, "vllm", facts.leader, LOADER, leader)
    index_env = {"name": GROUP_INDEX_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"}}}
    for patch, headless in ((worker_patch, True), (leader_patch, False)):
        vllm, loader = container(patch, "vllm"), container(patch, "ferry-load")
        args = vllm["args"]
        assert args[0] == "/ferry/weights"
        at = args.index("--nnodes")
        assert args[at:at + 6] == ["--nnodes", "2", "--node-rank", f"$({GROUP_INDEX_ENV})", "--master-addr",
                                   "$(LWS_LEADER_ADDRESS)"]
        assert args.count("--headless") == (1 if headless else 0)  # the user's --headless is Ferry's now
        assert index_env in vllm["env"] and index_env in loader["env"]
        assert loader["args"][-4:] == ["--group-size", "2", "--group-index", f"$({GROUP_INDEX_ENV})"]
        # Workers run headless: no HTTP server, so no /health probe; the leader serves and is probed.
        assert ("readinessProbe" in vllm) is not headless
        assert {"conditionType": "ferry.dev/weights-loaded"} in patch["spec"]["template"]["spec"]["readinessGates"]
    # Wired templates are current: nothing more to patch.
    worker_after = template_facts("llama", strategic.apply(lws()["spec"]["leaderWorkerTemplate"]["workerTemplate"],
                                                           worker_patch["spec"]["template"]))
    assert template_patch(spec, "llama", ARTIFACT, "vllm", worker_after, LOADER, workers) is None


def test_a_users_multi_node_flags_are_replaced_only_in_a_group():
    args = ["meta-llama/Llama-3.1-405B", "--nnodes", "4", "-r", "1", "--master-addr=10.0.0.1", "--headless"]
    facts = template_facts("llama", vllm_template(args))
    single = spec_with([{"kind": "StatefulSet", "name": "llama"}])
    wired = container(template_patch(single, "llama", ARTIFACT, "vllm", facts, LOADER), "vllm")["args"]
    assert wired[1:7] == ["--nnodes", "4", "-r", "1", "--master-addr=10.0.0.1", "--headless"]  # the user's own
    grouped = spec_with([{"kind": "StatefulSet", "name": "llama", "groupSize": 2}])
    sts = statefulset_facts({"metadata": {"name": "llama"}, "spec": {"replicas": 2, "serviceName": "hl",
                                                                      "template": vllm_template(args)}})
    group, _ = groups_of(grouped.serving.targets[0], sts)
    wired = container(template_patch(grouped, "llama", ARTIFACT, "vllm", sts, LOADER, group), "vllm")["args"]
    assert "4" not in wired and "-r" not in wired and "--headless" not in wired and "--master-addr=10.0.0.1" not in wired
    assert wired[wired.index("--master-addr") + 1] == "llama-0.hl"


# --- the planner ----------------------------------------------------------------


def planned(spec_obj: dict, workloads: dict):
    mw = parse(spec_obj)
    done = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(mw.spec)}
    facts = ArtifactFacts(uri="pvc://weights/llama/abc", total_bytes=1 << 30, manifest_digest=DIGEST)
    return plan(mw, Observed(steps=done, artifact=facts, workloads=workloads), loader=LOADER)


def test_the_planner_patches_both_templates_of_a_leaderworkerset_once():
    obj = manifest(format=PP2, serving={"targets": [{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}]})
    p = planned(obj, {"leaderworkerset/llama": leaderworkerset_facts(lws())})
    (action,) = [a for a in p.actions if isinstance(a, PatchWorkload)]
    assert (action.kind, action.name) == ("LeaderWorkerSet", "llama")
    assert action.patch is not None and action.leader_patch is not None
    assert "leaderworkerset llama patched" in {c.type: c for c in p.status.conditions}["Reconciling"].message


def test_a_group_size_the_workload_does_not_run_stalls_naming_both():
    obj = manifest(format=PP2, serving={"targets": [{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}]})
    p = planned(obj, {"leaderworkerset/llama": leaderworkerset_facts(lws(size=4))})
    stalled = {c.type: c for c in p.status.conditions}["Stalled"]
    assert stalled.status == "True" and stalled.reason == "GroupSizeMismatch"
    assert not [a for a in p.actions if isinstance(a, PatchWorkload)]


def test_a_missing_target_waits_under_its_kind():
    obj = manifest(format=PP2, serving={"targets": [{"kind": "StatefulSet", "name": "llama"}]})
    p = planned(obj, {"statefulset/llama": None})
    reconciling = {c.type: c for c in p.status.conditions}["Reconciling"]
    assert reconciling.reason == "WorkloadNotFound" and "statefulset llama not found" in reconciling.message


# --- the local strategic merge ---------------------------------------------------


def test_the_local_strategic_merge_merges_by_key_deletes_by_directive_and_replaces_other_lists():
    template = {"metadata": {"annotations": {"a": "1", "served": "x"}},
                "spec": {"containers": [{"name": "vllm", "args": ["old"], "env": [{"name": "AWS_KEY", "value": "k"},
                                                                                  {"name": "KEEP", "value": "v"}],
                                         "volumeMounts": [{"name": "w", "mountPath": "/ferry/weights"}]},
                                        {"name": "sidecar", "image": "s"}],
                         "volumes": [{"name": "w", "hostPath": {"path": "/x"}}],
                         "readinessGates": [{"conditionType": "user"}]}}
    patch = {"metadata": {"annotations": {"served": None, "digest": "d"}},
             "spec": {"containers": [{"name": "vllm", "args": ["new"], "env": [{"name": "AWS_KEY", "$patch": "delete"}],
                                      "volumeMounts": [{"mountPath": "/ferry/weights", "$patch": "delete"}]}],
                      "initContainers": [{"name": "ferry-load", "image": "f", "env": [{"name": "G", "value": "1"}]}],
                      "volumes": [{"name": "w", "$patch": "delete"}, {"name": "t", "emptyDir": {}}],
                      "readinessGates": [{"conditionType": "user"}, {"conditionType": "ferry"}]}}
    merged = strategic.apply(template, patch)
    assert merged["metadata"]["annotations"] == {"a": "1", "digest": "d"}
    vllm, sidecar = merged["spec"]["containers"]
    assert vllm["args"] == ["new"] and vllm["env"] == [{"name": "KEEP", "value": "v"}] and vllm["volumeMounts"] == []
    assert sidecar == {"name": "sidecar", "image": "s"}
    assert merged["spec"]["initContainers"] == [{"name": "ferry-load", "image": "f", "env": [{"name": "G", "value": "1"}]}]
    assert merged["spec"]["volumes"] == [{"name": "t", "emptyDir": {}}]
    assert [g["conditionType"] for g in merged["spec"]["readinessGates"]] == ["user", "ferry"]
    assert template["spec"]["containers"][0]["args"] == ["old"]  # the input is left alone
    swapped = strategic.apply(template, {"spec": {"volumes": [
        {"name": "w", "$retainKeys": ["name", "csi"], "csi": {"driver": "cache.ferry.dev"}}]}})
    assert swapped["spec"]["volumes"] == [{"name": "w", "csi": {"driver": "cache.ferry.dev"}}]  # no hostPath left
    with pytest.raises(strategic.UnsupportedPatch):
        strategic.apply(template, {"spec": {"$setElementOrder/containers": [{"name": "vllm"}]}})
    with pytest.raises(strategic.UnsupportedPatch):
        strategic.apply(template, {"spec": {"containers": [{"image": "no-name"}]}})
    with pytest.raises(strategic.UnsupportedPatch):
        strategic.apply(template, {"spec": {"volumes": [{"name": "w", "$patch": "replace"}]}})


def test_weights_loaded_counts_pods_and_whole_groups():
    from ferry_operator.serving.weights_loaded import pod_facts, summarize

    def pod(name: str, group: int, worker: int, gate: str) -> dict:
        return {"metadata": {"name": name, "labels": {"leaderworkerset.sigs.k8s.io/name": "llama",
                                                      "leaderworkerset.sigs.k8s.io/group-index": str(group),
                                                      "leaderworkerset.sigs.k8s.io/worker-index": str(worker)},
                             "annotations": {"ferry.dev/artifact-digest": DIGEST, "ferry.dev/modelweights": "llama"}},
                "status": {"conditions": [{"type": "ferry.dev/weights-loaded", "status": gate}]}}
    pods = [pod_facts(pod("llama-0", 0, 0, "True")), pod_facts(pod("llama-0-1", 0, 1, "True")),
            pod_facts(pod("llama-1", 1, 0, "True")), pod_facts(pod("llama-1-1", 1, 1, "Unknown"))]
    assert pods[1].workload == "leaderworkerset/llama" and pods[1].group == "leaderworkerset/llama#0"
    loads = summarize(pods, DIGEST, 4, {"leaderworkerset/llama": (2, 2)})
    assert loads.describe() == "3/4 pods loaded, 1/2 groups" and not loads.complete


def test_a_group_taken_back_to_one_pod_loses_ferrys_multi_node_flags_and_env():
    grouped = spec_with([{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}])
    facts = leaderworkerset_facts(lws())
    workers, _ = groups_of(grouped.serving.targets[0], facts)
    wired = strategic.apply(lws()["spec"]["leaderWorkerTemplate"]["workerTemplate"],
                            template_patch(grouped, "llama", ARTIFACT, "vllm", facts, LOADER, workers)["spec"]["template"])
    assert wired["metadata"]["annotations"]["ferry.dev/group-size"] == "2"
    single = spec_with([{"kind": "LeaderWorkerSet", "name": "llama"}])
    patch = template_patch(single, "llama", ARTIFACT, "vllm", template_facts("llama", wired), LOADER)
    after = strategic.apply(wired, patch["spec"]["template"])
    vllm = after["spec"]["containers"][0]
    assert not {"--nnodes", "--node-rank", "--master-addr", "--headless"} & set(vllm["args"]), vllm["args"]
    assert GROUP_INDEX_ENV not in [e["name"] for e in vllm.get("env", [])]
    (loader,) = after["spec"]["initContainers"]
    assert GROUP_INDEX_ENV not in [e["name"] for e in loader["env"]] and "--group-size" not in loader["args"]
    assert "ferry.dev/group-size" not in after["metadata"]["annotations"]
    assert template_patch(single, "llama", ARTIFACT, "vllm", template_facts("llama", after), LOADER) is None


def test_pods_that_serve_no_http_get_no_health_probe():
    """A headless LWS worker, and every pod of a StatefulSet group (they share a template; all but pod 0 run
    headless): readiness is the loader's gate; a probe copied from the leader is removed, never added."""
    spec = spec_with([{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}])
    probed = lws()
    probed["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["readinessProbe"] = {
        "httpGet": {"path": "/health", "port": 8000}}
    facts = leaderworkerset_facts(probed)
    workers, _ = groups_of(spec.serving.targets[0], facts)
    patch = template_patch(spec, "llama", ARTIFACT, "vllm", facts, LOADER, workers)
    assert container(patch, "vllm")["readinessProbe"] is None
    after = strategic.apply(probed["spec"]["leaderWorkerTemplate"]["workerTemplate"], patch["spec"]["template"])
    assert "readinessProbe" not in after["spec"]["containers"][0]
    assert template_patch(spec, "llama", ARTIFACT, "vllm", template_facts("llama", after), LOADER, workers) is None
    sts_spec = spec_with([{"kind": "StatefulSet", "name": "llama", "groupSize": 2}])
    sts = statefulset_facts({"metadata": {"name": "llama"}, "spec": {"replicas": 2, "serviceName": "hl",
                                                                      "template": vllm_template(["m"])}})
    group, _ = groups_of(sts_spec.serving.targets[0], sts)
    assert "readinessProbe" not in container(template_patch(sts_spec, "llama", ARTIFACT, "vllm", sts, LOADER, group),
                                             "vllm")


def test_a_leaderworkerset_is_rolled_out_only_once_its_pods_serve_the_artifact():
    """LWS keeps no observedGeneration: its status right after Ferry's patch still says the old groups are
    ready. Ready waits for every pod of the current artifact to be Ready."""
    from ferry_operator.serving.weights_loaded import PodFacts

    obj = manifest(format=PP2, serving={"readinessGate": False, "targets": [
        {"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}]})
    spec = parse(obj).spec
    body = lws(status={"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1})
    lwt = body["spec"]["leaderWorkerTemplate"]
    facts = leaderworkerset_facts(body)
    workers, leader = groups_of(spec.serving.targets[0], facts)
    for field, current, group in (("workerTemplate", facts, workers), ("leaderTemplate", facts.leader, leader)):
        lwt[field] = strategic.apply(lwt[field], template_patch(spec, "llama", ARTIFACT, "vllm", current, None,
                                                                group)["spec"]["template"])
    wired = leaderworkerset_facts(body)
    assert wired.rolled_out  # the stale status
    stale = planned(obj, {"leaderworkerset/llama": wired})
    assert {c.type: c for c in stale.status.conditions}["Ready"].status != "True"
    pods = [PodFacts(name=f"llama-0{s}", owner="llama", digest=DIGEST, gate=None, workload="leaderworkerset/llama",
                     ready=True) for s in ("", "-1")]
    mw = parse(obj)
    done = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(mw.spec)}
    facts_ = ArtifactFacts(uri="pvc://weights/llama/abc", total_bytes=1 << 30, manifest_digest=DIGEST)
    ready = plan(mw, Observed(steps=done, artifact=facts_, workloads={"leaderworkerset/llama": wired}, pods=pods))
    assert {c.type: c for c in ready.status.conditions}["Ready"].status == "True"


def test_a_groups_pods_keep_their_own_compiled_state_and_headless_pods_wait_on_the_leader():
    """serving.compiledState in a group: each pod's harvest keeps its own entry (--group-index), the leader's
    once its own vLLM serves, a worker's (no HTTP of its own) once the leader's /health answers, on the
    port the leader template's vLLM serves; the loader restores by the same index."""
    obj = manifest(format=PP2, serving={"targets": [{"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}],
                                        "compiledState": {"mode": "AfterFirstReady"}})
    spec = parse(obj).spec
    artifact = ARTIFACT.model_copy(update={"uri": "pvc://weights/llama/0b7e/abc/artifact"})
    body = lws()
    body["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["args"] += [
        "--port", "8080", "--ssl-keyfile", "/tls/key", "--ssl-certfile", "/tls/crt"]
    facts = leaderworkerset_facts(body)
    workers, leader = groups_of(spec.serving.targets[0], facts)
    index_env = {"name": GROUP_INDEX_ENV, "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"}}}
    for template, group, url in ((facts, workers, "https://$(LWS_LEADER_ADDRESS):8080/health"),
                                 (facts.leader, leader, "https://127.0.0.1:8080/health")):
        patch = template_patch(spec, "llama", artifact, "vllm", template, LOADER, group)
        harvest, loader = container(patch, "ferry-compiled-harvest"), container(patch, "ferry-load")
        args = harvest["args"]
        assert args[args.index("--health-url") + 1] == url
        assert args[-2:] == ["--group-index", f"$({GROUP_INDEX_ENV})"] and harvest["env"] == [index_env]
        assert "--compiled-key" in loader["args"] and loader["args"][-2:] == ["--group-index",
                                                                             f"$({GROUP_INDEX_ENV})"]
        after = template_facts("llama", strategic.apply(
            body["spec"]["leaderWorkerTemplate"]["leaderTemplate" if group is leader else "workerTemplate"],
            patch["spec"]["template"]))
        assert template_patch(spec, "llama", artifact, "vllm", after, LOADER, group) is None


def test_a_group_going_back_to_single_pods_leaves_no_group_index_in_the_harvest():
    obj = manifest(format=PP2, serving={"targets": [{"kind": "StatefulSet", "name": "llama", "groupSize": 2}],
                                        "compiledState": {"mode": "AfterFirstReady"}})
    artifact = ARTIFACT.model_copy(update={"uri": "pvc://weights/llama/0b7e/abc/artifact"})
    body = {"metadata": {"name": "llama"}, "spec": {"replicas": 2, "serviceName": "llama-hl",
                                                    "template": vllm_template(["m"])}}
    grouped_spec = parse(obj).spec
    group, _ = groups_of(grouped_spec.serving.targets[0], statefulset_facts(body))
    patch = template_patch(grouped_spec, "llama", artifact, "vllm", statefulset_facts(body), LOADER, group)
    template = strategic.apply(body["spec"]["template"], patch["spec"]["template"])
    obj["spec"]["serving"]["targets"][0]["groupSize"] = 1
    single = parse(obj).spec
    again = template_patch(single, "llama", artifact, "vllm", template_facts("llama", template), LOADER, None)
    after = strategic.apply(template, again["spec"]["template"])
    harvest = next(c for c in after["spec"]["initContainers"] if c["name"] == "ferry-compiled-harvest")
    assert "--group-index" not in harvest["args"] and GROUP_INDEX_ENV not in [e["name"] for e in harvest.get("env", [])]
    assert template_patch(single, "llama", artifact, "vllm", template_facts("llama", after), LOADER, None) is None


def test_the_status_keys_a_groups_template_as_its_wiring_does():
    """A StatefulSet group's pods wait on the leader's /health at its --master-addr, so a --host of their own
    keeps compiled state on in the wiring; the status computes the same key, not "--host" words."""
    obj = manifest(format=PP2, serving={"targets": [{"kind": "StatefulSet", "name": "llama", "groupSize": 2}],
                                        "compiledState": {"mode": "AfterFirstReady"}})
    mw = parse(obj)
    uri = "pvc://weights/llama/0b7e/abc/artifact"
    artifact = ARTIFACT.model_copy(update={"uri": uri})
    body = {"metadata": {"name": "llama"}, "spec": {"replicas": 2, "serviceName": "llama-hl",
                                                    "template": vllm_template(["m", "--host", "$(POD_IP)"])}}
    group, _ = groups_of(mw.spec.serving.targets[0], statefulset_facts(body))
    patch = template_patch(mw.spec, "llama", artifact, "vllm", statefulset_facts(body), LOADER, group)
    loader = container(patch, "ferry-load")
    key = loader["args"][loader["args"].index("--compiled-key") + 1]
    body["spec"]["template"] = strategic.apply(body["spec"]["template"], patch["spec"]["template"])
    done = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(mw.spec)}
    facts = ArtifactFacts(uri=uri, total_bytes=1 << 30, manifest_digest=DIGEST)
    status = plan(mw, Observed(steps=done, artifact=facts, workloads={"statefulset/llama": statefulset_facts(body)}),
                  loader=LOADER).status.compiled_state
    assert status.key == key and "--host" not in status.message
