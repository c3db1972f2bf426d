"""The kubernetes executor: prepare steps as Jobs on a PVC (the Helm default).

A thin adapter: the objects come from `jobs.py`; this only creates and reads
them. Create calls tolerate 409 so a restarted operator converges.
"""
from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ..api.types import ModelWeights
from ..planner import ArtifactFacts, StepPhase, StepState
from ..steps import Step
from . import jobs


def _create(fn, *args: Any) -> None:
    try:
        fn(*args)
    except ApiException as exc:
        if exc.status != 409:  # already there: fine, objects are deterministic
            raise


class KubernetesExecutor:
    def __init__(self, settings: jobs.WorkerSettings):
        self.settings = settings
        self.core = client.CoreV1Api()
        self.batch = client.BatchV1Api()
        self.rbac = client.RbacAuthorizationV1Api()
        self._identities: set[str] = set()

    def start(self, mw: ModelWeights, uid: str, step: Step) -> None:
        ns = mw.metadata.namespace
        if ns not in self._identities:
            sa, binding = jobs.worker_identity(ns, self.settings)
            _create(self.core.create_namespaced_service_account, ns, sa)
            _create(self.rbac.create_namespaced_role_binding, ns, binding)
            self._identities.add(ns)
        pvc = jobs.pvc_manifest(mw, uid)
        if pvc is not None:
            _create(self.core.create_namespaced_persistent_volume_claim, ns, pvc)
        _create(self.batch.create_namespaced_job, ns, jobs.job_manifest(mw, step, uid, self.settings))

    def _pods(self, mw: ModelWeights, step: Step) -> list[Any]:
        selector = f"job-name={jobs.job_name(mw, step)}"
        return self.core.list_namespaced_pod(mw.metadata.namespace, label_selector=selector).items

    def _messages(self, mw: ModelWeights, step: Step) -> list[str]:
        out = []
        for pod in sorted(self._pods(mw, step), key=lambda p: p.metadata.creation_timestamp):
            for cs in (pod.status.container_statuses or []):
                term = cs.state.terminated if cs.state else None
                if term is not None and term.message:
                    out.append(term.message.strip())
        return out

    def observe(self, mw: ModelWeights, step: Step) -> StepState:
        try:
            job = self.batch.read_namespaced_job(jobs.job_name(mw, step), mw.metadata.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return StepState(StepPhase.NOT_STARTED)
            raise
        for cond in job.status.conditions or []:
            if cond.status != "True":
                continue
            if cond.type == "Complete":
                return StepState(StepPhase.SUCCEEDED)
            if cond.type == "Failed":
                messages = self._messages(mw, step)
                detail = messages[-1].splitlines()[-1] if messages else cond.message or cond.reason
                return StepState(StepPhase.FAILED, f"{cond.reason}: {detail}")
        return StepState(StepPhase.RUNNING)

    def artifact(self, mw: ModelWeights, last: Step) -> ArtifactFacts | None:
        for message in reversed(self._messages(mw, last)):
            result = jobs.parse_result(message)
            if result is not None:
                return ArtifactFacts(uri=jobs.artifact_uri(mw, last.digest), total_bytes=int(result["totalBytes"]),
                                     manifest_digest=result["manifestDigest"])
        return None
