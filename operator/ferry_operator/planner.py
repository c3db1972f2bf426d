"""The reconcile planner: observed state in, actions and status out. Pure.

The kopf handlers gather what is (the spec, the status, each step's state from
the executor) and apply what this returns; every decision lives here so it is
tested without a cluster.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from datetime import timedelta
from enum import Enum
from typing import Any

from pydantic import ValidationError

from .api.types import (Artifact, CompiledStateMode, CompiledStateStatus, Condition, ConditionType, LoadedReplicas,
                        ModelWeights, ModelWeightsStatus, Progress, ServingTarget, StepRetry, WorkloadKind)
from .conditions import get_condition, now, phase_of, set_condition
from .node_cache import CachePlan, FillFacts, FillNode, RemoveFill, Template, cache_plan, refusal_notes
from .placement import NodeFacts
from .serving.wiring import ServingError, WorkloadFacts, loader_applies, node_cache_on, template_patch
from .serving.compiled import WarmUpFacts, changed, compiled_key, plan_compiled, pod_outcome
from .serving.loader import LOADER_CONTAINER, LoaderSettings
from .steps import Step, UnsupportedSpec, prepare_steps
from .serving.diagnosis import UNSCHEDULABLE, WAITING_REASONS, PodTrouble
from .serving.weights_loaded import PodFacts, summarize
from .serving.workloads import groups_of
from .serving.rollout import RolloutPatch, rollout_patch, surge_hint


INT64_MAX = 2**63 - 1
# A worker's progress report is a few hundred bytes of JSON; a larger one is not one (executors drop it unread).
MAX_PROGRESS_REPORT_BYTES = 4096


class StepPhase(str, Enum):
    NOT_STARTED = "NotStarted"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


@dataclass(frozen=True)
class StepState:
    """A step as the executor sees it. `reason` (CamelCase) names why a step is
    FAILED (the Stalled reason, e.g. SecretNotFound) or why a RUNNING one waits
    (the Reconciling reason, e.g. Unschedulable); `message` says what to do."""

    phase: StepPhase
    message: str = ""
    reason: str = ""
    # A FAILED step that may succeed if run again (a crash, a network error);
    # not one that rejected its input or waits on a fix (a missing Secret).
    retryable: bool = False
    # A RUNNING step's last progress report, as its worker sent it (untrusted:
    # a worker parses untrusted bytes); validated before it reaches the status.
    progress: dict[str, Any] | None = None


@dataclass(frozen=True)
class ArtifactFacts:
    """What the executor read from a completed artifact's manifest."""

    uri: str
    total_bytes: int
    manifest_digest: str
    # How a MoE artifact's experts were cut (the manifest's extra); None: a dense model, or not reported.
    experts: int | None = None
    expert_parallel: bool | None = None
    target: str | None = None


@dataclass(frozen=True)
class Observed:
    steps: dict[str, StepState] = field(default_factory=dict)  # by Step.id
    artifact: ArtifactFacts | None = None  # the artifact of the current spec, once complete
    workloads: dict[str, WorkloadFacts | None] = field(default_factory=dict)  # by ServingTarget.key; None: not found
    requested_at: str | None = None  # the ferry.dev/requested-at annotation
    pods: list[PodFacts] = field(default_factory=list)  # serving pods wired for this ModelWeights
    # Deployment name -> the ModelWeights that owns it (ownership.owner_of), for those several name.
    owners: dict[str, str] = field(default_factory=dict)
    # serving.nodeCache: this object's fill Jobs (None: the executor runs none), and the nodes that
    # serving.nodeCache.prewarm.nodeSelector selects.
    fills: list[FillFacts] | None = None
    prewarm_nodes: list[str] = field(default_factory=list)
    # The Nodes the operator's node index holds (labels, taints), by name: where fills may go.
    nodes: dict[str, NodeFacts] = field(default_factory=dict)
    # Whether the cluster runs Ferry's node agent (the chart's nodeCache.enabled): without it, no fill.
    node_agent: bool = False
    # The node labels a prewarm may select by (the chart's nodeCache.prewarmNodeLabels); None: any label.
    prewarm_labels: tuple[str, ...] | None = None
    # The nodes whose node agent keeps their cache labels: node -> its cache.ferry.dev/ labels.
    cache_nodes: dict[str, dict[str, str]] = field(default_factory=dict)
    # serving.compiledState BeforeRollout: this object's warm-up Jobs by key (None: the executor runs none).
    warm_ups: dict[str, WarmUpFacts] | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """Failed steps are retried `limit` times, `base_s` * 2**n apart (capped)."""

    limit: int = 3
    base_s: float = 30.0
    cap_s: float = 600.0

    def delay(self, attempt: int) -> float:
        return min(self.cap_s, self.base_s * (2 ** attempt))


@dataclass(frozen=True)
class StartStep:
    step: Step


@dataclass(frozen=True)
class RetryStep:
    """Clear a failed step's run (its Job, its worker state) so it starts again."""

    step: Step
    attempt: int


@dataclass(frozen=True)
class RemoveArtifact:
    """Remove a superseded artifact: its data and its Jobs (or worker records)."""

    artifact: Artifact


@dataclass(frozen=True)
class PatchWorkload:
    name: str
    patch: dict | None  # strategic merge of the pod template ({"spec": {"template": ...}}); None: unchanged
    # The pods' loader reports with this ServiceAccount's token: bind it the reporter role first.
    reporter_service_account: str | None = None
    kind: str = "Deployment"
    # A LeaderWorkerSet's leaderTemplate, patched the same way (None: unchanged, or none), the account its
    # pods report with, and the resourceVersion both templates were planned from.
    leader_patch: dict | None = None
    leader_service_account: str | None = None
    resource_version: str = ""
    # A Deployment's strategy for Ferry's rollout (serving.rollout), sent in the same patch as the template.
    rollout: RolloutPatch | None = None


@dataclass(frozen=True)
class WarmUp:
    """BeforeRollout: run one pod of workload `name`'s template with `patch` applied (the wiring Ferry holds
    back meanwhile) as a Job that keeps the compiled state of `key`."""

    name: str
    patch: dict
    key: str
    reporter_service_account: str | None = None
    resource_version: str = ""  # the Deployment's, as the patch was planned from: a Job of a changed one is not made


@dataclass(frozen=True)
class RemoveWarmUp:
    """A running warm-up Job of a key no workload waits for any more (the template changed again, the mode
    went): it goes, with its pod and the accelerators it holds."""

    job: str


@dataclass
class Plan:
    actions: list[StartStep | RetryStep | PatchWorkload | RemoveArtifact | FillNode | RemoveFill | WarmUp
                  | RemoveWarmUp]
    status: ModelWeightsStatus
    # Seconds until the handlers should look again (None: only on change).
    requeue_after: float | None
    # A prewarm holds the rollout, or a node no wired pod may use waits for a fix: fill Jobs, nodes and the
    # spec send events, so the handlers may look less often.
    held: bool = False


def recorded_artifact(mw: ModelWeights, steps: list[Step], expected_uri: str | None,
                      verified: ArtifactFacts | None = None) -> ArtifactFacts | None:
    """The artifact the status already records for this spec, if any: then every
    step is done, and the Jobs, pods or worker state that said so may be gone.
    Only where the executor itself writes this spec's artifact (`expected_uri`):
    a record pointing anywhere else (a status patched by hand or by a forged
    report) is not this object's artifact, and the steps are observed afresh.

    The status says which artifact; how big and how cut come from `verified` (the
    executor's own record of the last step's validated result) whenever it has one, as
    it does while the last step's Job is kept. Without one (an operator restarted after
    that Job and its pods went), the status's facts, which act on nothing but this
    object's own: the node agent holds a fill to the bytes it declares and charges them
    to the fill's namespace, and the expert facts shape only this object's flags."""
    art = mw.status.artifact if mw.status else None
    if not steps or art is None or art.spec_digest != steps[-1].digest or not art.manifest_digest:
        return None
    if art.uri != expected_uri:
        return None
    if verified is not None and verified.uri == art.uri:
        return verified
    return ArtifactFacts(uri=art.uri, total_bytes=art.total_bytes, manifest_digest=art.manifest_digest,
                         experts=art.experts, expert_parallel=art.expert_parallel, target=art.target)


def reported_progress(report: dict[str, Any] | None, step: str) -> Progress | None:
    """A worker's progress report as the CRD's Progress, or None if it is not one
    (or names another step): the operator writes the status, the worker only reports."""
    if not isinstance(report, dict):
        return None
    try:
        progress = Progress.model_validate(report)
    except ValidationError:
        return None
    # int64 on the wire: a larger number would make every status write of the object fail.
    too_large = any(v is not None and v > INT64_MAX for v in (progress.bytes_done, progress.bytes_total,
                                                             progress.bytes_per_second, progress.eta_seconds))
    return progress if progress.step == step and not too_large else None


def human_bytes(n: int) -> str:
    for unit in ("", "Ki", "Mi", "Gi", "Ti", "Pi"):
        if n < 1024 or unit == "Pi":
            return f"{n:.0f}{unit}" if unit == "" or n >= 100 else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Draft:
    """The status a plan is computing, and the named outcomes that end it."""

    def __init__(self, mw: ModelWeights) -> None:
        self.generation = mw.metadata.generation or 0
        self.status = (mw.status or ModelWeightsStatus()).model_copy(deep=True)
        self.conditions: list[Condition] = list(self.status.conditions)
        self.at = now()

    def cond(self, t: ConditionType, value: bool | None, reason: str, message: str) -> None:
        self.conditions = set_condition(self.conditions, t, value, reason, message, self.generation, self.at)

    def clear_stalled(self) -> None:
        # A Stalled left by an earlier failure or generation ends once work moves again.
        if get_condition(self.conditions, ConditionType.STALLED) is not None:
            self.cond(ConditionType.STALLED, False, "Progressing", "")

    def finish(self, artifact: Artifact | None, actions: list, running: str | None = None,
               requeue: float | None = None) -> Plan:
        return _finish(self.status, self.conditions, self.generation, artifact, actions, running, requeue)

    def stalled(self, reason: str, message: str, artifact: Artifact | None = None,
                step: ConditionType | None = None) -> Plan:
        """Waiting will not help: Stalled, neither Ready nor Reconciling (and the step's condition False)."""
        if step is not None:
            self.cond(step, False, reason, message)
        self.cond(ConditionType.STALLED, True, reason, message)
        self.cond(ConditionType.RECONCILING, False, reason, message)
        self.cond(ConditionType.READY, False, reason, message)
        return self.finish(artifact, [])

    def in_progress(self, reason: str, message: str, artifact: Artifact | None, actions: list,
                    step: ConditionType, step_reason: str, running: str | None = None,
                    requeue: float = 2.0) -> Plan:
        """Work under way: Reconciling with `reason`; not Ready, and the step's
        condition False, both with `step_reason`."""
        self.cond(step, False, step_reason, message)
        self.cond(ConditionType.RECONCILING, True, reason, message)
        self.cond(ConditionType.READY, False, step_reason, message)
        return self.finish(artifact, actions, running, requeue)


def plan(mw: ModelWeights, observed: Observed, retries: RetryPolicy = RetryPolicy(), keep_previous: int = 1,
         loader: LoaderSettings | None = None) -> Plan:
    """`keep_previous`: how many superseded artifacts deletionPolicy Retain keeps;
    `loader`: the serving-side loader to wire (None: none, and no readiness gate).
    Three phases: the prepare steps, the artifact they made, its serving."""
    draft = _Draft(mw)
    status = draft.status
    # A new value of the annotation is a human asking for a retry now.
    requested = bool(observed.requested_at) and observed.requested_at != status.last_handled_requested_at
    if observed.requested_at:
        status.last_handled_requested_at = observed.requested_at
    try:
        steps = prepare_steps(mw.spec)
    except UnsupportedSpec as exc:
        return draft.stalled("UnsupportedSpec", str(exc))
    if status.retry is not None and status.retry.step not in {s.id for s in steps}:
        status.retry = None  # a retry of a superseded spec's step
    preparing = _prepare(mw, observed, steps, draft, retries, requested)
    if preparing is not None:  # a new artifact: every key will hash it, so no running warm-up is waited for
        preparing.actions += _moot_warm_ups(observed, set())
        return preparing
    artifact = observed.artifact
    if steps and artifact is None:
        # Steps succeeded but the manifest is not readable: never call that complete.
        message = "all steps succeeded but the artifact has no readable manifest"
        draft.cond(ConditionType.STALLED, True, "ArtifactIncomplete", message)
        draft.cond(ConditionType.READY, False, "ArtifactIncomplete", message)
        return draft.finish(None, [])
    facts = _artifact_facts(mw, steps, artifact)
    if artifact is not None:
        draft.cond(ConditionType.PREPARED, True, "Prepared", f"{facts.size} at {artifact.uri}")
    else:
        draft.cond(ConditionType.PREPARED, True, "NothingToPrepare", "vLLM streams the weights from the source")
    return _serve(mw, observed, facts, draft, loader, keep_previous)


def _prepare(mw: ModelWeights, observed: Observed, steps: list[Step], draft: _Draft, retries: RetryPolicy,
             requested: bool) -> Plan | None:
    """The steps in order: the plan while one fails or runs; None once all succeeded."""
    status = draft.status
    for step in steps:
        state = observed.steps.get(step.id, StepState(StepPhase.NOT_STARTED))
        retry = status.retry if status.retry is not None and status.retry.step == step.id else None
        if state.phase == StepPhase.SUCCEEDED:
            if retry is not None:
                status.retry = None  # it went through
            if step.name == "fetch":
                draft.cond(ConditionType.DOWNLOADED, True, "Fetched", "weights fetched and verified")
            continue
        if state.phase == StepPhase.FAILED:
            return _failed(mw, step, state, retry, draft, retries, requested)
        actions = [StartStep(step)] if state.phase == StepPhase.NOT_STARTED else []
        return _running(step, state, draft, actions)
    return None


def _running(step: Step, state: StepState, draft: _Draft, actions: list) -> Plan:
    status = draft.status
    draft.clear_stalled()
    earlier = status.progress if status.progress is not None and status.progress.step == step.name else None
    status.progress = reported_progress(state.progress, step.name) or earlier
    message = f"step {step.name} {'starting' if actions else 'running'}"
    if state.message:
        # Still in progress, but held up by something a human may want to see
        # (an unschedulable pod, a retry after a failed attempt).
        message += f": {state.message}"
    if step.name == "fetch":
        draft.cond(ConditionType.DOWNLOADED, False, "Fetching", message)
    return draft.in_progress(state.reason or step.name.capitalize(), message, None, actions,
                             ConditionType.PREPARED, "Preparing", running=step.name)


def _failed(mw: ModelWeights, step: Step, state: StepState, retry: StepRetry | None, draft: _Draft,
            retries: RetryPolicy, requested: bool) -> Plan:
    """A failed step: retried with backoff while it may succeed (or a human asks), else Stalled."""
    status, at = draft.status, draft.at
    message = f"{step.name} failed: {state.message}".strip()
    reason = state.reason or f"{step.name.capitalize()}Failed"
    attempt = 0 if requested or retry is None else retry.attempt
    if requested or (state.retryable and attempt < retries.limit):
        actions: list = []
        due = None if requested or retry is None else retry.next_attempt_at
        if due is None and not requested:
            # First sight of this failure: schedule the retry.
            due = at + timedelta(seconds=retries.delay(attempt))
            status.retry = StepRetry(step=step.id, attempt=attempt, last_error=message[:2048], next_attempt_at=due)
        if requested or at >= due:
            status.retry = StepRetry(step=step.id, attempt=attempt + 1, last_error=message[:2048])
            actions.append(RetryStep(step, attempt + 1))
            wait = f"retry {attempt + 1} of {retries.limit} starting"
        else:
            wait = f"retry {attempt + 1} of {retries.limit} in {max(0, int((due - at).total_seconds()))}s"
        draft.clear_stalled()
        return draft.in_progress("Retrying", f"{message}; {wait}", None, actions, ConditionType.PREPARED,
                                 "Retrying", running=step.name, requeue=1.0)
    if retry is not None and retry.attempt:
        message += f" (after {retry.attempt} {'retry' if retry.attempt == 1 else 'retries'})"
    if state.retryable or retry is not None:
        message += f"; to retry: kubectl annotate mw/{mw.metadata.name} ferry.dev/requested-at=$(date +%s)"
    draft.cond(ConditionType.STALLED, True, reason, message)
    draft.cond(ConditionType.RECONCILING, False, "Failed", message)
    draft.cond(ConditionType.READY, False, reason, message)
    if step.name == "fetch":
        draft.cond(ConditionType.DOWNLOADED, False, state.reason or "FetchFailed", message)
    draft.cond(ConditionType.PREPARED, False, reason, message)
    return draft.finish(None, [])


def _artifact_facts(mw: ModelWeights, steps: list[Step], artifact: ArtifactFacts | None) -> Artifact:
    """The status's record of the artifact (or, with nothing prepared, of the source vLLM streams)."""
    fmt = mw.spec.format
    return Artifact(
        uri=artifact.uri if artifact else mw.spec.source.uri, format=fmt.type,
        tensor_parallel_size=fmt.tensor_parallel_size, pipeline_parallel_size=fmt.pipeline_parallel_size,
        vllm_version=fmt.vllm_version,
        total_bytes=artifact.total_bytes if artifact else 0,
        size=human_bytes(artifact.total_bytes) if artifact else None,
        manifest_digest=artifact.manifest_digest if artifact else None,
        experts=artifact.experts if artifact else None,
        expert_parallel=artifact.expert_parallel if artifact else None,
        target=artifact.target if artifact else None,
        spec_digest=steps[-1].digest if artifact and steps else None,
    )


@dataclass
class _Progress:
    """What _serve gathers over the serving targets: the actions to take, the words for what it waits on,
    whether a rollout is held back (a warm-up Job, the node cache's fills), and the keys a warm-up Job is run
    for now."""

    actions: list = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    held: bool = False
    pending: set[str] = field(default_factory=set)


def _moot_warm_ups(observed: Observed, pending: set[str]) -> list[RemoveWarmUp]:
    """Running warm-up Jobs of keys no workload waits for: they go, with the accelerators they hold."""
    return [RemoveWarmUp(job.job) for key, job in (observed.warm_ups or {}).items()
            if job.phase == "Running" and key not in pending]


def _serve(mw: ModelWeights, observed: Observed, facts: Artifact, draft: _Draft, loader: LoaderSettings | None,
           keep_previous: int) -> Plan:
    """Wire each Deployment, follow its rollout and its pods' loaders; Ready once all serve the artifact."""
    status = draft.status
    targets = mw.spec.serving.workloads() if mw.spec.serving else []
    gated = bool(targets) and loader_applies(mw.spec, facts, loader)
    progress = _Progress()
    cache = _node_cache(mw, observed, facts, draft)
    if isinstance(cache, Plan):
        return cache
    if cache is not None:
        progress.actions += cache.actions
        progress.waiting += cache.notes
        progress.held = bool(cache.refused)
    before = mw.status.compiled_state if mw.status else None
    warmed = list(before.warmed) if before is not None else []
    for target in targets:
        stalled = _serve_target(mw, observed, facts, draft, target, loader, gated, cache, warmed, progress)
        if stalled is not None:
            return stalled
    progress.actions += _moot_warm_ups(observed, progress.pending)
    status.compiled_state = _compiled_status(mw, observed, facts, targets, gated)
    if status.compiled_state is not None and warmed:
        status.compiled_state = status.compiled_state.model_copy(update={"warmed": warmed[-8:]})
    loading_only = False
    status.loaded = None
    if gated:
        failed, loading = _loaded(mw, observed, facts, draft, progress.actions)
        if failed is not None:
            return failed
        if loading is not None:
            loading_only = not progress.waiting  # every Deployment is wired and rolled out: only loaders work
            progress.waiting.append(loading)
    else:
        draft.conditions = [c for c in draft.conditions if c.type != ConditionType.WEIGHTS_LOADED.value]
    return _serving_plan(mw, observed, facts, draft, targets, progress, loading_only, keep_previous)


def _serve_target(mw: ModelWeights, observed: Observed, facts: Artifact, draft: _Draft, target: ServingTarget,
                  loader: LoaderSettings | None, gated: bool, cache: CachePlan | None, warmed: list[str],
                  progress: _Progress) -> Plan | None:
    """One serving target: wire it (or wait for its warm-up Job, or the node cache), follow its rollout.
    A stalled plan when it cannot be wired at all."""
    current = observed.workloads.get(target.key)
    if current is None:
        progress.waiting.append(f"{target.describe()} not found")
        return None
    owner = observed.owners.get(target.key, mw.metadata.name)
    if owner != mw.metadata.name:
        message = (f"{target.describe()} is wired by ModelWeights {owner}; remove it from {owner}'s "
                   f"serving (or delete {owner}) and Ferry wires it for {mw.metadata.name}")
        return draft.stalled("DeploymentClaimed", message, facts, ConditionType.SERVING_UPDATED)
    try:
        patch = _wire(mw, facts, target, current, loader, gated)
    except ServingError as exc:  # ParallelismUnsupported among them, under its own reason
        return draft.stalled(exc.reason, str(exc), facts, ConditionType.SERVING_UPDATED)
    warming = _warm_up(mw, observed, target, current, patch, warmed)
    if warming is not None:  # the wiring waits for the warm-up Job; the workload stays as it is
        key, start, words = warming
        progress.pending.add(key)
        progress.actions += [start] if start is not None else []
        progress.waiting.append(words)
        progress.held = True
        return None
    held_back = patch is not None and cache is not None and cache.hold
    roll = _rollout(mw, target, current, patch is not None and not held_back)
    if held_back:
        progress.waiting.append(f"{target.describe()} waits: {cache.hold}")
        progress.held = True
        if roll is not None:  # the last rollout's strategy goes back while the next one is held
            progress.actions.append(PatchWorkload(target.name, None, kind=target.kind, rollout=roll))
    elif patch is not None:
        progress.actions.append(replace(patch, rollout=roll))
        progress.waiting.append(f"{target.describe()} patched")
    elif roll is not None:
        progress.actions.append(PatchWorkload(target.name, None, kind=target.kind, rollout=roll))
        progress.waiting.append(roll.message)
    elif not current.rolled_out or not _pods_caught_up(observed, target, current, facts):
        progress.waiting.append(f"{target.describe()} rolling out")
    return None


def _serving_plan(mw: ModelWeights, observed: Observed, facts: Artifact, draft: _Draft,
                  targets: list[ServingTarget], progress: _Progress, loading_only: bool, keep_previous: int) -> Plan:
    """Ready when nothing is awaited; else in progress under the reason of what it waits on, or stalled by a
    pod trouble that no action of this plan will clear."""
    waiting, actions = progress.waiting, progress.actions
    found = _serving_trouble(observed, facts, targets) if waiting else None
    trouble = found[0] if found is not None else None
    if trouble is not None and trouble.stalls and not actions:
        return draft.stalled(trouble.reason, "; ".join([*waiting, trouble.message]), facts,
                             ConditionType.SERVING_UPDATED)
    draft.clear_stalled()
    if not waiting:
        return _ready(mw, facts, draft, keep_previous, actions)
    reason = "DeploymentNotFound" if any("not found" in w for w in waiting) else "RollingOut"
    if reason == "DeploymentNotFound" and not any(w.startswith("deployment ") and "not found" in w
                                                  for w in waiting):
        reason = "WorkloadNotFound"
    if loading_only:
        reason = "WeightsLoading"
    if found is not None:
        waiting.append(trouble.message + _surge_hint(mw, observed, *found))
        reason = trouble.reason if trouble.reason in WAITING_REASONS else reason
    out = draft.in_progress(reason, "; ".join(waiting), facts, actions, ConditionType.SERVING_UPDATED, reason)
    out.held = progress.held
    return out


def _warm_up(mw: ModelWeights, observed: Observed, target: ServingTarget, current: WorkloadFacts,
             patch: PatchWorkload | None, warmed: list[str]) -> tuple[str, WarmUp | None, str] | None:
    """BeforeRollout: (the key, the Job to start or None, what the wiring waits for) while the new template's
    key has no kept state yet; None: wire now. A key whose Job finished, kept or failed, is added to `warmed`
    (the status keeps it): a failed warm-up does not hold the rollout, whose first Ready pod keeps the state.
    Not for a key the workload runs already (a rewiring that keeps it), nor for pods that bind node ports."""
    setting = mw.spec.serving.compiled_state if mw.spec.serving else None
    if setting is None or setting.mode != CompiledStateMode.BEFORE_ROLLOUT.value or patch is None \
            or patch.patch is None or target.kind != WorkloadKind.DEPLOYMENT.value or observed.warm_ups is None \
            or current.host_ports:
        return None
    inits = ((patch.patch.get("spec") or {}).get("template") or {}).get("spec", {}).get("initContainers") or []
    key = compiled_key(next((c.get("args") or [] for c in inits if c.get("name") == LOADER_CONTAINER), []))
    if not key or key in warmed or key == _wired_key(current):
        return None
    job = observed.warm_ups.get(key)
    if job is None:
        return (key, WarmUp(target.name, patch.patch, key, patch.reporter_service_account, current.resource_version),
                f"{target.describe()} waits: a warm-up Job keeps the compiled state of its new template first")
    if job.phase == "Running":
        why = (f"; {job.message}; or set serving.compiledState.mode: AfterFirstReady to roll without it"
               if job.message else "")
        return key, None, f"{target.describe()} waits for warm-up Job {job.job}{why}"
    warmed.append(key)
    return None


def _wired_key(current: WorkloadFacts) -> str:
    """The compiled-state key the workload's template is wired with now ("" if none)."""
    return compiled_key(current.init_containers.get(LOADER_CONTAINER, {}).get("args") or [])


def _rollout(mw: ModelWeights, target: ServingTarget, current: WorkloadFacts,
             patching: bool) -> RolloutPatch | None:
    """The strategy change Ferry's rollout of `target` needs now (serving/rollout.py): in place as it starts
    (or while one runs with old pods left, once the user turned InPlace on), put back once it completed."""
    policy = mw.spec.serving.rollout.strategy if mw.spec.serving else "Workload"
    rolling = patching or (not current.rolled_out and current.old_pods > 0)
    return rollout_patch(policy, target.kind, target.name, current.strategy, current.saved_strategy, rolling,
                         current.rolled_out and not patching, current.resource_version)


def _compiled_status(mw: ModelWeights, observed: Observed, facts: Artifact, targets: list[ServingTarget],
                     gated: bool) -> CompiledStateStatus | None:
    """status.compiledState: the first wired workload's key (or why it has none) and its pods' outcomes."""
    setting = mw.spec.serving.compiled_state if mw.spec.serving else None
    if setting is None or setting.mode == CompiledStateMode.OFF.value or not targets:
        return None
    target = targets[0]
    current = observed.workloads.get(target.key)
    if current is None:
        return CompiledStateStatus(message=f"{target.describe()} not found")
    name, words = current.served(target.container)
    group, _ = groups_of(target, current)  # the worker template's, as the wiring keys it
    compiled = plan_compiled(mw.spec, facts, current.images.get(name, ""), words, gated,
                             current.envs.get(name, []), group)
    if not compiled.on:
        return CompiledStateStatus(message=compiled.reason)
    before = mw.status.compiled_state if mw.status else None
    if _wired_key(current) != compiled.key:  # the template is not (re)wired for this key yet: say so once it is
        return before or CompiledStateStatus(message="the template is being wired")
    digest = facts.manifest_digest or facts.uri
    names = {t.key for t in targets}
    outcomes = [(p.name, pod_outcome(p.message)) for p in sorted(observed.pods, key=lambda p: p.name)
                if p.digest == digest and p.workload in names and not p.terminating]
    outcomes = [(pod, o) for pod, o in outcomes if o is not None]
    restored = sum(1 for _, (state, _) in outcomes if state == "restored")
    message = "no pod of the current template has loaded yet"
    if outcomes:
        pod, (state, reason) = next(((p, o) for p, o in outcomes if o[0] != "restored"), outcomes[0])
        message = f"pod {pod}: {state}: {reason}"
    if before is not None and before.key and before.key != compiled.key:
        what = changed(before.inputs, compiled) or "its configuration"
        message = f"new key: {what} changed, so pods compile afresh until one keeps the new state; {message}"
    elif before is not None and before.key == compiled.key and before.message.startswith("new key:") \
            and restored == 0:
        message = before.message.split(_MOVED, 1)[0]  # said until a pod of the new key restores
    moved = _moved_tag(current.images.get(name, ""), name, [p for p in observed.pods if p.digest == digest
                                                           and p.workload == target.key and not p.terminating])
    if moved:
        message = f"{message}; {moved}"
    warm_up = (observed.warm_ups or {}).get(compiled.key)
    if warm_up is not None and warm_up.phase == "Failed" and restored == 0:
        message = (f"warm-up Job {warm_up.job} failed ({warm_up.message or 'no words'}), so the rollout went on "
                   f"without it and the first Ready pod keeps the state; {message}")
    return CompiledStateStatus(key=compiled.key, inputs=dict(compiled.inputs), restored_replicas=restored,
                               message=message[:1024])


# A pod's imageID: a repository digest (`repo@sha256:…`, what a registry pull reports) or a bare config id
# (`sha256:…`, an image loaded onto the node). Either names the bytes; the two forms of one image differ, so
# each is compared only with its own kind.
_IMAGE_DIGEST = re.compile(r"(?:(\S+)@)?sha256:([0-9a-f]{64})")
_MOVED = "; the pods run "  # how _moved_tag's words join the message (a kept message drops them)


def _moved_tag(image: str, container: str, pods: list[PodFacts]) -> str:
    """Words for pods of one template that run `image` (a reference by tag) as different bytes: its tag
    moved between their pulls (or between the images loaded onto their nodes); "" if not. The key holds the
    reference, not the bytes, so such pods share one entry; vLLM's own cache key (its code and compiler
    hashes) tells the bytes apart, so a pod on other bytes compiles afresh and its harvest replaces the entry."""
    if not image or "@sha256:" in image:
        return ""
    seen: dict[bool, set[str]] = {}  # by form (a repository digest or not): the digests the pods report
    for p in pods:
        if dict(p.images).get(container) != image:
            continue
        for found in (_IMAGE_DIGEST.fullmatch(i) for c, i in p.image_ids if c == container):
            if found is not None:
                seen.setdefault(found.group(1) is not None, set()).add(found.group(2))
    moved = sorted(max(seen.values(), key=len, default=set()))
    if len(moved) < 2:
        return ""
    shown = ", ".join(d[:12] for d in moved[:4])
    return (f"the pods run {image} as {len(moved)} different images ({shown}): the tag moved; compiled state is "
            f"kept by image reference, vLLM's own key tells the bytes apart, and pods on other bytes compile "
            f"afresh; pin the image by digest ({image.split('@')[0]}@sha256:...) to key it by its bytes")


def _pods_caught_up(observed: Observed, target: ServingTarget, current: WorkloadFacts, facts: Artifact) -> bool:
    """A LeaderWorkerSet keeps no observedGeneration: right after a patch its status still describes the
    old groups. Rolled out only once every pod it runs is of the current artifact and Ready."""
    if current.kind != WorkloadKind.LEADER_WORKER_SET.value:
        return True
    digest = facts.manifest_digest or facts.uri
    ready = [p for p in observed.pods if p.workload == target.key and p.digest == digest and p.ready
             and not p.terminating]
    return len(ready) >= current.replicas


def _wire(mw: ModelWeights, facts: Artifact, target: ServingTarget, current: WorkloadFacts,
          loader: LoaderSettings | None, gated: bool) -> PatchWorkload | None:
    """The patch that wires `target` (both templates of a LeaderWorkerSet), None if it is wired."""
    group, leader_group = groups_of(target, current)
    name = mw.metadata.name or ""
    patch = template_patch(mw.spec, name, facts, target.container, current, loader, group)
    leader_patch = None
    if current.leader is not None:
        leader_patch = template_patch(mw.spec, name, facts, target.container, current.leader, loader, leader_group)
    if patch is None and leader_patch is None:
        return None
    leader_account = current.leader.service_account if gated and current.leader is not None else None
    return PatchWorkload(target.name, patch, current.service_account if gated else None, kind=target.kind,
                         leader_patch=leader_patch, resource_version=current.resource_version,
                         leader_service_account=leader_account)


def _node_cache(mw: ModelWeights, observed: Observed, facts: Artifact, draft: _Draft) -> CachePlan | Plan | None:
    """The node cache's fills and status.cache (serving.nodeCache); a stalled plan if it cannot be had."""
    if not node_cache_on(mw.spec) or not facts.manifest_digest or not facts.uri.startswith(("pvc://", "s3://")):
        draft.status.cache = None
        # Turned off: its fill Jobs go (the entries stay on the nodes until evicted).
        return CachePlan(actions=[RemoveFill(f.node, f.digest, f.round) for f in observed.fills or []])
    if observed.fills is None:
        return draft.stalled("NodeCacheUnavailable", "serving.nodeCache needs the kubernetes executor (the chart) "
                             "and its node agent (nodeCache.enabled): the local executor has no nodes to cache "
                             "on; remove serving.nodeCache", facts, ConditionType.SERVING_UPDATED)
    if not observed.node_agent:
        return draft.stalled("NodeCacheUnavailable", "serving.nodeCache: Ferry was installed without its node "
                             "agent (the chart's nodeCache.enabled is false), so no node can hold the artifact "
                             "and no fill Job is made; ask the cluster admin to enable it, or remove "
                             "serving.nodeCache", facts, ConditionType.SERVING_UPDATED)
    unlisted = _unlisted_prewarm_labels(mw, observed)
    if unlisted:
        return draft.stalled("PrewarmLabelNotAllowed", unlisted, facts, ConditionType.SERVING_UPDATED)
    cache = cache_plan(mw.spec, facts, observed.fills, observed.pods, observed.prewarm_nodes, draft.at,
                       labelled=observed.cache_nodes, previous=mw.status.cache if mw.status else None,
                       nodes=observed.nodes, templates=_templates(mw, observed))
    prewarm = mw.spec.serving.node_cache.prewarm
    if prewarm is not None and not observed.prewarm_nodes:
        cache.notes.append(f"no node matches serving.nodeCache.prewarm.nodeSelector {prewarm.node_selector}")
    refused = refusal_notes(cache.refused)
    if prewarm is not None and observed.prewarm_nodes and set(observed.prewarm_nodes) <= set(cache.refused):
        message = (f"serving.nodeCache.prewarm.nodeSelector {prewarm.node_selector} selects only nodes the "
                   f"serving pods may not use, so no fill Job is made: {'; '.join(refused)}; select nodes of the "
                   f"workload's own pool, or give its pod template the toleration, nodeSelector or affinity "
                   f"for them")
        stalled = draft.stalled("PrewarmNodesRefused", message, facts, ConditionType.SERVING_UPDATED)
        stalled.actions = [a for a in cache.actions if isinstance(a, RemoveFill)]  # fills running there go
        return stalled
    cache.notes += [f"no fill on {r}" for r in refused]
    draft.status.cache = cache.status
    return cache


def _unlisted_prewarm_labels(mw: ModelWeights, observed: Observed) -> str:
    """Why the prewarm's nodeSelector may not be used ("" if it may): a label the cluster admin does not
    let prewarms select by."""
    prewarm = mw.spec.serving.node_cache.prewarm
    if prewarm is None or observed.prewarm_labels is None:
        return ""
    unlisted = sorted(set(prewarm.node_selector) - set(observed.prewarm_labels))
    if not unlisted:
        return ""
    return (f"serving.nodeCache.prewarm.nodeSelector selects by {', '.join(unlisted)}, a label the cluster admin "
            f"does not let prewarms select by (the chart's nodeCache.prewarmNodeLabels: "
            f"{', '.join(observed.prewarm_labels) or 'none'}); select by those, or remove the prewarm")


def _templates(mw: ModelWeights, observed: Observed) -> list[Template]:
    """The wired pod templates that were read, in the spec's order, with what they are called."""
    out: list[Template] = []
    for target in mw.spec.serving.workloads() if mw.spec.serving else []:
        current = observed.workloads.get(target.key)
        if current is None:
            continue
        which = "workerTemplate" if current.leader is not None else "pod template"
        out.append((f"{target.describe()}'s {which}", current.placement))
        if current.leader is not None:
            out.append((f"{target.describe()}'s leaderTemplate", current.leader.placement))
    return out


def _serving_trouble(observed: Observed, facts: Artifact,
                     targets: list[ServingTarget]) -> tuple[PodTrouble, str] | None:
    """What keeps a pod of the current template of a wired Deployment from
    serving (serving/diagnosis.py), and the workload's key: the first one that needs a human, else the
    first one waiting, by pod name. Old ReplicaSets' pods are on their way out."""
    digest = facts.manifest_digest or facts.uri
    names = {t.key for t in targets}
    troubles = [(p.trouble, p.workload) for p in sorted(observed.pods, key=lambda p: p.name)
                if p.trouble is not None and p.digest == digest and p.workload in names and not p.terminating]
    return next((t for t in troubles if t[0].stalls), troubles[0] if troubles else None)


def _surge_hint(mw: ModelWeights, observed: Observed, trouble: PodTrouble, workload: str) -> str:
    current = observed.workloads.get(workload)
    if trouble.reason != UNSCHEDULABLE or current is None:
        return ""
    return surge_hint(mw.metadata.name or "", current, trouble.message)


def _loaded(mw: ModelWeights, observed: Observed, facts: Artifact, draft: _Draft,
            actions: list) -> tuple[Plan | None, str | None]:
    """status.loaded and WeightsLoaded from the serving pods' loaders: (the plan
    if one failed, what is still loading if not all have)."""
    targets = mw.spec.serving.workloads() if mw.spec.serving else []
    found = [(t, observed.workloads.get(t.key)) for t in targets]
    replicas = sum(d.replicas for _, d in found if d is not None)
    groups = {t.key: (t.pods_per_group, d.groups) for t, d in found if d is not None and t.pods_per_group > 1}
    loads = summarize(observed.pods, facts.manifest_digest or "", replicas, groups)
    draft.status.loaded = LoadedReplicas(replicas=loads.replicas, loaded_replicas=loads.loaded, summary=loads.text,
                                         p50_load_seconds=loads.p50_seconds)
    text = loads.describe()
    if loads.p50_seconds is not None:
        text += f" (p50 {loads.p50_seconds:g}s)"
    if loads.failing is None:
        draft.cond(ConditionType.WEIGHTS_LOADED, loads.complete, "Loaded" if loads.complete else "Loading", text)
        return None, None if loads.complete else text
    bad = loads.failing
    message = f"{text}; pod {bad.name}: {bad.reason}: {bad.message}"
    draft.cond(ConditionType.WEIGHTS_LOADED, False, bad.reason, message)
    if bad.reason == "VerificationFailed":
        # The prepared files are not what the manifest says: waiting will not fix that.
        draft.cond(ConditionType.STALLED, True, "WeightsVerificationFailed", message)
    draft.cond(ConditionType.RECONCILING, True, "WeightsLoadFailed", message)
    draft.cond(ConditionType.READY, False, "WeightsLoadFailed", message)
    return draft.finish(facts, actions, requeue=2.0), None


def _ready(mw: ModelWeights, facts: Artifact, draft: _Draft, keep_previous: int, actions: list) -> Plan:
    """Every Deployment serves the current artifact: Ready, and superseded
    artifacts may go (Delete removes them all, Retain all but the newest keep_previous). `actions`: serving's
    that do not hold Ready (a turned-off node cache's fills to remove)."""
    status = draft.status
    targets = mw.spec.serving.workloads() if mw.spec.serving else []
    if targets:
        draft.cond(ConditionType.SERVING_UPDATED, True, "RolledOut",
                   ", ".join(t.name if t.kind == "Deployment" else t.describe() for t in targets)
                   + " serve the artifact")
    draft.cond(ConditionType.RECONCILING, False, "Ready", "")
    draft.cond(ConditionType.READY, True, "Ready",
               "artifact prepared and verified" + ("; serving workloads rolled out" if targets else "")
               + (f"; weights loaded by {status.loaded.summary} replicas" if status.loaded else ""))
    _supersede(status, facts)
    status.artifact = facts
    keep = 0 if mw.spec.deletion_policy == "Delete" else keep_previous
    removals = [RemoveArtifact(a) for a in status.previous_artifacts[keep:]]
    status.previous_artifacts = status.previous_artifacts[:keep]
    return draft.finish(facts, [*actions, *removals])


def _supersede(status: ModelWeightsStatus, current: Artifact) -> None:
    """Move the recorded artifact of an earlier spec to previous_artifacts."""
    old = status.artifact
    if old is None or old.spec_digest is None or old.spec_digest == current.spec_digest:
        return
    if all(a.spec_digest != old.spec_digest for a in status.previous_artifacts):
        status.previous_artifacts = [old, *status.previous_artifacts][:16]


def blocked(status: ModelWeightsStatus | None, generation: int, reason: str, message: str) -> ModelWeightsStatus:
    """The status when reconciling cannot proceed at all (a spec this build cannot
    read, an API permission the operator lacks): Stalled, neither Ready nor
    Reconciling. What was observed before (artifact, step conditions) is kept;
    the next reconcile that gets through recomputes everything."""
    status = (status or ModelWeightsStatus()).model_copy(deep=True)
    conditions = list(status.conditions)
    at = now()
    for t, value in ((ConditionType.STALLED, True), (ConditionType.READY, False), (ConditionType.RECONCILING, False)):
        conditions = set_condition(conditions, t, value, reason, message, generation, at)
    status.conditions = sorted(conditions, key=lambda c: c.type)
    status.observed_generation = generation
    status.phase = phase_of(status.conditions, None)
    return status


def _finish(status: ModelWeightsStatus, conditions: list[Condition], generation: int, artifact: Artifact | None,
            actions: list[StartStep | RetryStep | PatchWorkload | RemoveArtifact], running: str | None,
            requeue: float | None = None) -> Plan:
    status.conditions = sorted(conditions, key=lambda c: c.type)
    status.observed_generation = generation
    status.phase = phase_of(status.conditions, running)
    if artifact is not None:
        _supersede(status, artifact)  # still served by old pods until Ready: only listed here
        status.artifact = artifact
    if running is None and status.progress is not None and status.phase != "Failed":
        status.progress = None  # the step that reported it is over
    return Plan(actions=actions, status=status, requeue_after=requeue)
