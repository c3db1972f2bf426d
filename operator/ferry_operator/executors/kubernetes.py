"""The kubernetes executor: prepare steps as Jobs on a PVC (the Helm default).

A thin adapter: the objects come from `jobs.py`, the reading of what the
cluster says about them from `diagnosis.py` (which counts only the pods the
Job controller made for the Job, results included); this only creates and
reads them. A file:// source is refused before any Job exists. Create calls
tolerate 409 so a restarted operator converges. Reads are the API's own JSON
(no client models), which is what `diagnosis` takes.
Any other API error, a 403 included, propagates: the handlers report it. The one exception is a warm-up
Job the API server refuses (a quota, a webhook): it counts as a failed warm-up, so the rollout goes on.

Jobs and their pods are read from `view` when the handlers give one (kopf
indexes fed by label-selected watches: observing a preparing step costs the
API server nothing); without one (a test driving the executor directly), by
GET and LIST. A view may lag a create by a moment: the step then looks
NotStarted once more and the create answers 409, which is success.
"""
from __future__ import annotations

import json
import threading
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable, Protocol

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ..api.types import Artifact, ModelWeights
from ..planner import ArtifactFacts, StepPhase, StepState
from ..locations import (claim_artifact_uri, claim_name, ferry_s3_artifacts, is_ferry_s3_artifact,
                         s3_compiled_store_uri)
from ..placement import Placement
from ..steps import Step, prepare_steps
from ..serving import strategic
from ..serving.compiled import WarmUpFacts
from . import cache_fill, diagnosis, jobs, warm_up

# Warm-up Jobs the API server refused, remembered per (object uid, key) while the operator runs: at most this
# many (the oldest go first; a forgotten one is tried again, and refused again, once).
REFUSALS = 256
# What a refusal of a create is when it is not the operator's permissions (RBAC) nor an outage: the object
# itself is refused (a quota, a LimitRange, an admission webhook or policy).
REFUSED = (400, 403, 422)


def _create(fn, *args: Any) -> None:
    try:
        fn(*args)
    except ApiException as exc:
        if exc.status != 409:  # already there: fine, objects are deterministic
            raise


def _read(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """The object as the API serves it (JSON), or None if it does not exist."""
    try:
        response = fn(*args, _preload_content=False, **kwargs)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return json.loads(response.data)


def _makes_artifact(mw: ModelWeights, step: Step) -> bool:
    """Whether this step's result is the artifact's (the last step's)."""
    steps = prepare_steps(mw.spec)
    return bool(steps) and steps[-1].id == step.id


class ClusterView(Protocol):
    def job(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def pods(self, namespace: str, job_name: str) -> list[dict[str, Any]]: ...
    def step_jobs(self, namespace: str, mw_name: str, step: str) -> list[dict[str, Any]]: ...


class KubernetesExecutor:
    def __init__(self, settings: jobs.WorkerSettings):
        self.settings = settings
        self.view: ClusterView | None = None
        self.core = client.CoreV1Api()
        self.batch = client.BatchV1Api()
        self.apps = client.AppsV1Api()
        self.rbac = client.RbacAuthorizationV1Api()
        self.storage = client.StorageV1Api()
        self._identities: set[str] = set()
        # (object uid, last step id) -> its validated result: the operator's own record of the artifact's
        # size and MoE facts, kept past the Job (the status is not trusted for them).
        self._results: dict[tuple[str, str], ArtifactFacts] = {}
        self._refused: dict[tuple[str, str], WarmUpFacts] = {}  # (object uid, key) -> a refused warm-up Job
        self._refused_lock = threading.Lock()

    def _ensure_identity(self, ns: str) -> None:
        if ns not in self._identities:
            sa, binding = jobs.worker_identity(ns, self.settings)
            _create(self.core.create_namespaced_service_account, ns, sa)
            _create(self.rbac.create_namespaced_role_binding, ns, binding)
            self._identities.add(ns)

    def start(self, mw: ModelWeights, uid: str, step: Step) -> None:
        ns = mw.metadata.namespace
        self._ensure_identity(ns)
        pvc = jobs.pvc_manifest(mw, uid)
        if pvc is not None:
            _create(self.core.create_namespaced_persistent_volume_claim, ns, pvc)
        _create(self.batch.create_namespaced_job, ns, jobs.job_manifest(mw, step, uid, self.settings))

    def _job(self, mw: ModelWeights, step: Step) -> dict[str, Any] | None:
        if self.view is not None:
            return self.view.job(mw.metadata.namespace, jobs.job_name(mw, step))
        return _read(self.batch.read_namespaced_job, jobs.job_name(mw, step), mw.metadata.namespace)

    @staticmethod
    def _not_ours(mw: ModelWeights, job: dict[str, Any]) -> StepState | None:
        """A Job under this step's name that this ModelWeights does not own (someone who may
        create Jobs made it first): never adopted, its pods' results never read."""
        refs = (job.get("metadata") or {}).get("ownerReferences") or []
        if any(r.get("controller") and r.get("uid") == mw.metadata.uid for r in refs):
            return None
        return StepState(StepPhase.FAILED, reason="JobNotOwned", message=(
            f"Job {job['metadata'].get('name')} exists and is not this ModelWeights' (its controller is not "
            f"uid {mw.metadata.uid}): delete it and Ferry starts its own"))

    def _pods(self, mw: ModelWeights, step: Step) -> list[dict[str, Any]]:
        if self.view is not None:
            return self.view.pods(mw.metadata.namespace, jobs.job_name(mw, step))
        selector = f"job-name={jobs.job_name(mw, step)}"
        listed = _read(self.core.list_namespaced_pod, mw.metadata.namespace, label_selector=selector)
        return list((listed or {}).get("items") or [])

    def observe(self, mw: ModelWeights, step: Step) -> StepState:
        refused = jobs.unsupported_source(mw)
        if refused is not None:  # before any Job: a Job would read the pod's own files
            return StepState(StepPhase.FAILED, refused, reason=diagnosis.UNSUPPORTED_SOURCE)
        ns = mw.metadata.namespace
        job = self._job(mw, step)
        if job is None:
            return self._claim_not_owned(mw) or StepState(StepPhase.NOT_STARTED)
        if (foreign := self._not_ours(mw, job)) is not None:
            return foreign
        if job["metadata"].get("deletionTimestamp"):
            return StepState(StepPhase.RUNNING, "the failed attempt's Job is being removed", reason="Retrying")
        pods = self._pods(mw, step)
        claims = {name: _read(self.core.read_namespaced_persistent_volume_claim, name, ns)
                  for name in diagnosis.claims_to_read(job, pods)}
        classes = {name: _read(self.storage.read_storage_class, name) is not None
                   for name in diagnosis.storage_classes_to_check(claims)}
        state = diagnosis.diagnose(job, pods, claims, classes, needs_result=_makes_artifact(mw, step))
        if state.phase == StepPhase.RUNNING:
            state = replace(state, progress=diagnosis.reported_progress(job, pods))
        return state

    # -- the node cache's fill Jobs (serving.nodeCache) ---------------------------------------------------------
    def _owned_jobs(self, mw: ModelWeights, step: str) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """This object's Jobs of one kind (its `ferry.dev/step` label) that it owns and that are not going, each
        with its pods (from the view; without one, none)."""
        ns, name = mw.metadata.namespace, mw.metadata.name
        if self.view is not None:
            found = self.view.step_jobs(ns, name, step)
        else:
            selector = f"{jobs.LABEL_MW}={name},{jobs.LABEL_STEP}={step}"
            found = list((_read(self.batch.list_namespaced_job, ns, label_selector=selector) or {}).get("items") or [])
        owned = [j for j in found if self._not_ours(mw, j) is None and not j["metadata"].get("deletionTimestamp")]
        return [(j, self.view.pods(ns, j["metadata"]["name"]) if self.view is not None else []) for j in owned]

    def fills(self, mw: ModelWeights) -> list:
        """This object's fill Jobs (those it owns), as node_cache.FillFacts."""
        return [cache_fill.fill_facts(j, pods) for j, pods in self._owned_jobs(mw, cache_fill.FILL_STEP)]

    def fill(self, mw: ModelWeights, uid: str, node: str, artifact: Artifact, round_: int,
             placement: Placement | None = None) -> None:
        self._ensure_identity(mw.metadata.namespace)
        _create(self.batch.create_namespaced_job, mw.metadata.namespace,
                cache_fill.fill_job_manifest(mw, uid, node, artifact, round_, self.settings, placement))

    # -- serving.compiledState BeforeRollout: warm-up Jobs -------------------------------------------------------
    def warm_ups(self, mw: ModelWeights) -> dict:
        """This object's warm-up Jobs (those it owns) by key, as serving.compiled.WarmUpFacts."""
        now = datetime.now(timezone.utc) if self.view is not None else None  # only the view sees every pod
        facts = [warm_up.warm_up_facts(j, pods, now) for j, pods in self._owned_jobs(mw, warm_up.WARM_UP_STEP)]
        with self._refused_lock:
            refused = {key: f for (uid, key), f in self._refused.items() if uid == mw.metadata.uid}
        return {**refused, **{f.key: f for f in facts if f.key}}

    def warm_up(self, mw: ModelWeights, uid: str, name: str, patch: dict[str, Any], key: str,
                resource_version: str = "") -> None:
        """Start the warm-up Job of Deployment `name`'s template with Ferry's pending `patch` applied: the
        template the key was computed from (a Deployment changed since is planned again, not warmed)."""
        deployment = _read(self.apps.read_namespaced_deployment, name, mw.metadata.namespace)
        if deployment is None or (resource_version and deployment["metadata"].get("resourceVersion")
                                  != resource_version):
            return  # gone or changed since it was read: the next reconcile plans from what it is now
        template = strategic.apply(deployment["spec"]["template"], patch["spec"]["template"])
        job = warm_up.warm_up_job_manifest(mw, uid, key, template,
                                           (deployment["spec"].get("selector") or {}).get("matchLabels") or {})
        try:
            self.batch.create_namespaced_job(mw.metadata.namespace, job)
        except ApiException as exc:
            if exc.status == 409:
                return self._squatted(mw, uid, key, job["metadata"]["name"])
            if exc.status not in REFUSED or (exc.status == 403 and diagnosis.rbac_denied(exc.body)):
                raise  # an outage is retried; a permission the operator lacks stalls, naming the grant
            self._refuse(uid, WarmUpFacts(key, job["metadata"]["name"], "Failed", (
                f"the API server refused to create it: {diagnosis.api_message(exc.body, str(exc))}")[:512]))

    def _squatted(self, mw: ModelWeights, uid: str, key: str, name: str) -> None:
        """The warm-up's name is taken. Ours (a reconcile before this one made it): followed as it is. Another's
        (someone who may create Jobs made it first): never waited for, so it cannot hold the rollout."""
        found = _read(self.batch.read_namespaced_job, name, mw.metadata.namespace)
        if found is None or found["metadata"].get("deletionTimestamp"):
            return  # gone or going: the next reconcile creates Ferry's own
        if self._not_ours(mw, found) is not None:
            self._refuse(uid, WarmUpFacts(key, name, "Failed", (
                f"Job {name} exists and is not this ModelWeights' (its controller is not uid {mw.metadata.uid}), "
                f"so Ferry made none: delete that Job to let the next change warm up first")))

    def _refuse(self, uid: str, facts: WarmUpFacts) -> None:
        with self._refused_lock:
            self._refused[(uid, facts.key)] = facts
            while len(self._refused) > REFUSALS:
                del self._refused[next(iter(self._refused))]

    def remove_warm_up(self, mw: ModelWeights, job: str) -> None:
        try:
            self.batch.delete_namespaced_job(job, mw.metadata.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise

    def remove_fill(self, mw: ModelWeights, node: str, digest: str, round_: int) -> None:
        try:
            self.batch.delete_namespaced_job(cache_fill.fill_job_name(mw, node, digest, round_),
                                             mw.metadata.namespace, propagation_policy="Background")
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _claim_not_owned(self, mw: ModelWeights) -> StepState | None:
        """A claim Ferry is to create (storage.pvc.size) that already exists and is
        not this ModelWeights': never written into (it may be another team's).
        A claim named in storage.pvc.name is authorised as the user at admission."""
        pvc = mw.spec.storage.pvc if mw.spec.storage else None
        if pvc is None or pvc.size is None:  # a claim named to be reused: authorised at admission
            return None
        uid, name = mw.metadata.uid or "", claim_name(mw)
        found = _read(self.core.read_namespaced_persistent_volume_claim, name, mw.metadata.namespace)
        if found is None:
            return None
        meta = found.get("metadata") or {}
        # Its own: labelled with its uid (or, made by an older Ferry, owned by it for garbage collection).
        if (meta.get("labels") or {}).get(jobs.LABEL_MW_UID) == uid or any(
                ref.get("uid") == uid for ref in meta.get("ownerReferences") or []):
            return None
        return StepState(StepPhase.FAILED, reason="ClaimNotOwned", message=(
            f"claim {name} already exists and is not this ModelWeights' (no label {jobs.LABEL_MW_UID}={uid}): "
            "Ferry creates a claim only under a free name. Name a claim you may use in storage.pvc.name "
            "(without size, to reuse it), or free the name"))

    def retry(self, mw: ModelWeights, step: Step) -> None:
        """Remove the failed Job and its pods (foreground): once it is gone the
        step is NotStarted and the planner starts it again, under the same name."""
        try:
            self.batch.delete_namespaced_job(jobs.job_name(mw, step), mw.metadata.namespace,
                                             propagation_policy="Foreground")
        except ApiException as exc:
            if exc.status != 404:
                raise

    def remove_artifact(self, mw: ModelWeights, uid: str, artifact: Artifact) -> None:
        """A superseded artifact: its Jobs go, and a cleanup Job removes its data from the claim."""
        ns, digest = mw.metadata.namespace, artifact.spec_digest
        for key in [k for k in self._results if k[0] == mw.metadata.uid and k[1].endswith(f"-{digest}")]:
            del self._results[key]  # its record goes with it: the same spec again prepares afresh
        listed = _read(self.batch.list_namespaced_job, ns, label_selector=f"{jobs.LABEL_MW}={mw.metadata.name}")
        for job in (listed or {}).get("items") or []:
            if ((job["metadata"].get("annotations") or {}).get("ferry.dev/step-id") or "").endswith(f"-{digest}"):
                try:
                    self.batch.delete_namespaced_job(job["metadata"]["name"], ns, propagation_policy="Background")
                except ApiException as exc:
                    if exc.status != 404:
                        raise
        # Only what this object wrote: its own uid-carrying directory on the claim
        # (never the recorded URI's), and an S3 prefix only if it is its own.
        if is_ferry_s3_artifact(mw, artifact):
            # The objects its manifest names, then its staging on the claim.
            _create(self.batch.create_namespaced_job, ns,
                    jobs.cleanup_job_manifest(mw, digest, uid, self.settings, s3_uri=artifact.uri))
        else:  # on the claim, or an S3 URI that is not its own: only its directory on the claim
            _create(self.batch.create_namespaced_job, ns, jobs.cleanup_job_manifest(mw, digest, uid, self.settings))

    def delete(self, mw: ModelWeights) -> None:
        """deletionPolicy Delete: the claim goes by garbage collection (its owner
        reference); S3 artifacts Ferry wrote are removed by a Job each."""
        artifacts = ferry_s3_artifacts(mw)
        for artifact in artifacts:
            _create(self.batch.create_namespaced_job, mw.metadata.namespace,
                    jobs.s3_delete_job_manifest(mw, artifact.uri, self.settings))
        store = s3_compiled_store_uri(mw)
        if artifacts and store:  # its compiled state beside them, kept or not (the setting may be off by now)
            _create(self.batch.create_namespaced_job, mw.metadata.namespace,
                    jobs.s3_delete_job_manifest(mw, store, self.settings, compiled=True))

    def finished(self, mw: ModelWeights, steps: list[Step]) -> None:
        """The artifact is recorded in the status: the Jobs of its earlier steps may go (TTL controller),
        and so may the fetched original its later steps read (staging). The last step's Job stays while its
        artifact is current (remove_artifact takes it with the artifact): its pod's validated result, not the
        status, is where the artifact's size and MoE facts come from after a restart."""
        if len(steps) > 1:  # the fetch wrote to staging, not to the artifact
            _create(self.batch.create_namespaced_job, mw.metadata.namespace,
                    jobs.staging_cleanup_job_manifest(mw, steps[-1].digest, mw.metadata.uid or "", self.settings))
        for step in steps[:-1]:  # the last step's Job stays: its pod's result is the record of the artifact
            try:
                self.batch.patch_namespaced_job(jobs.job_name(mw, step), mw.metadata.namespace,
                                                {"spec": {"ttlSecondsAfterFinished": jobs.FINISHED_JOB_TTL_S}})
            except ApiException as exc:
                if exc.status != 404:
                    raise

    def artifact_uri(self, mw: ModelWeights, last: Step) -> str:
        """Where this executor writes the artifact of the spec `last` ends."""
        return claim_artifact_uri(mw, last.digest)

    def artifact(self, mw: ModelWeights, last: Step) -> ArtifactFacts | None:
        """The last step's result, from its Job's own pods only (observe reports a malformed one), and only
        from pods created before the Job completed: one planted later (its owner reference forged) is no
        worker of it. Read once, then from this executor's record of it: the Job may expire, and a pod
        created after the record changes nothing."""
        key = (mw.metadata.uid or "", last.id)
        if key in self._results:
            return self._results[key]
        job = self._job(mw, last)
        if job is None or self._not_ours(mw, job) is not None:
            return None
        try:
            result = diagnosis.step_result(job, _before_completion(job, self._pods(mw, last)))
        except jobs.MalformedResult:
            return None
        if result is None:
            return None
        facts = ArtifactFacts(
            uri=claim_artifact_uri(mw, last.digest), total_bytes=result.total_bytes,
            manifest_digest=result.manifest_digest, experts=result.experts,
            expert_parallel=result.expert_parallel, target=result.target)
        self._results[key] = facts
        return facts


def _before_completion(job: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pods created no later than the Job's completion (all of them while it runs)."""
    done = (job.get("status") or {}).get("completionTime")
    if not done:
        return pods
    return [p for p in pods if (p.get("metadata") or {}).get("creationTimestamp", "") <= done]
