"""kopf handlers: thin glue between the cluster, the executor and the planner.

One timer per ModelWeights observes the executor's steps, asks the planner
what to do, starts what it says, and writes the status it computed.
"""
from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import kopf

from .api.types import GROUP, PLURAL, VERSION, ConditionType, ModelWeightsStatus
from .api.validation import InvalidSpec, parse
from .conditions import set_condition
from .executors.local import LocalExecutor
from .planner import Observed, plan
from .steps import UnsupportedSpec, prepare_steps, spec_digest

RECONCILE_INTERVAL = float(os.environ.get("FERRY_RECONCILE_INTERVAL", "2"))
log = logging.getLogger("ferry_operator")


def make_executor() -> LocalExecutor:
    kind = os.environ.get("FERRY_EXECUTOR", "local")
    if kind != "local":
        raise SystemExit(f"FERRY_EXECUTOR={kind!r}: only the local executor is implemented in this build")
    ferry = shutil.which("ferry") or str(Path(sys.executable).with_name("ferry"))
    return LocalExecutor(
        root=Path(os.environ.get("FERRY_LOCAL_ROOT", ".ferry/artifacts")).resolve(),
        ferry_bin=ferry,
        kubeconfig=os.environ.get("KUBECONFIG"),
    )


EXECUTOR: LocalExecutor | None = None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    global EXECUTOR
    EXECUTOR = make_executor()
    # Keep kopf's bookkeeping in annotations: status belongs to the API's schema.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="ferry.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="ferry.dev", key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING


def _status_patch(before: dict[str, Any], after: ModelWeightsStatus) -> dict[str, Any]:
    """The status fields the operator owns, as a merge patch; empty if nothing changed."""
    new = after.model_dump(by_alias=True, mode="json", exclude_none=True)
    patch: dict[str, Any] = {}
    for key in ("observedGeneration", "phase", "conditions", "artifact"):
        if key in new and new[key] != before.get(key):
            patch[key] = new[key]
    if "progress" in before and after.progress is None:
        patch["progress"] = None
    return patch


@kopf.timer(GROUP, VERSION, PLURAL, interval=RECONCILE_INTERVAL, initial_delay=0)
def reconcile(body: kopf.Body, namespace: str, name: str, patch: kopf.Patch, **_: Any) -> None:
    assert EXECUTOR is not None
    raw_status = dict(body.get("status") or {})
    try:
        mw = parse(dict(body))
        steps = prepare_steps(mw.spec)
    except (InvalidSpec, UnsupportedSpec) as exc:
        status = ModelWeightsStatus.model_validate(raw_status) if raw_status else ModelWeightsStatus()
        generation = body["metadata"].get("generation", 0)
        for t, value in ((ConditionType.STALLED, True), (ConditionType.READY, False),
                         (ConditionType.RECONCILING, False)):
            status.conditions = set_condition(status.conditions, t, value, type(exc).__name__, str(exc), generation)
        status.observed_generation = generation
        status.phase = "Failed"
        patch.status.update(_status_patch(raw_status, status))
        return
    observed = Observed(
        steps={s.id: EXECUTOR.observe(namespace, name, s) for s in steps},
        artifact=EXECUTOR.artifact(namespace, name, spec_digest(mw.spec)) if steps else None,
    )
    result = plan(mw, observed)
    for action in result.actions:
        log.info("%s/%s: starting step %s", namespace, name, action.step.id)
        EXECUTOR.start(namespace, name, action.step, mw.spec.source.uri)
    patch.status.update(_status_patch(raw_status, result.status))


@kopf.on.delete(GROUP, VERSION, PLURAL)
def delete(spec: kopf.Spec, namespace: str, name: str, logger: logging.Logger, **_: Any) -> None:
    assert EXECUTOR is not None
    if spec.get("deletionPolicy") == "Delete":
        logger.info("deletionPolicy Delete: removing prepared data")
        EXECUTOR.delete(namespace, name)
