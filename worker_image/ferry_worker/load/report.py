"""The pod condition `ferry.dev/weights-loaded`: what the loader tells the
readiness gate, through the API server.

In a serving pod the operator mounts a projected, pod-bound service account
token into the loader's container only (TOKEN_DIR) and sets POD_NAME from the
downward API. The token's ServiceAccount is bound to the ClusterRole
`ferry-weights-reporter` (patch pods/status); the admission policy of the same
name lets a pod-bound token of such an account change only that one condition,
and only on its own pod (charts/ferry/templates/weights-reporter.yaml); the
patch itself is pod_status.set_condition.
"""
from __future__ import annotations

import logging
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from ..pod_status import STANDARD_TOKEN_DIR, connect, set_condition

log = logging.getLogger(__name__)

CONDITION = "ferry.dev/weights-loaded"
TOKEN_DIR = Path("/var/run/secrets/ferry.dev/serviceaccount")

# Reasons (CamelCase, as condition reasons are).
LOADING = "Loading"
LOADED = "Loaded"
VERIFICATION_FAILED = "VerificationFailed"  # a file is missing, the wrong size or the wrong content
LOAD_FAILED = "LoadFailed"  # anything else: an I/O error, an unreadable store


class Reporter(Protocol):
    def report(self, loaded: bool, reason: str, message: str) -> None: ...


class NoReport:
    """Outside a pod (or --no-report): the exit status and the output say it all."""

    def report(self, loaded: bool, reason: str, message: str) -> None:
        pass


class PodConditionReporter:
    def __init__(self, pod: str, namespace: str, core_api: Any) -> None:
        self.pod = pod
        self.namespace = namespace
        self._api = core_api
        self._last: tuple[bool, str] | None = None
        self._since = ""

    @classmethod
    def connect(cls, pod: str, token_dir: Path) -> "PodConditionReporter":
        core_api, namespace = connect(token_dir)
        return cls(pod, namespace, core_api)

    def condition(self, loaded: bool, reason: str, message: str) -> dict[str, Any]:
        key = (loaded, reason)
        if self._last is None or self._last[0] != loaded:
            self._since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._last = key
        return {"type": CONDITION, "status": "True" if loaded else "False", "reason": reason,
                "message": message[:4096], "lastTransitionTime": self._since, "lastProbeTime": None}

    def report(self, loaded: bool, reason: str, message: str) -> None:
        set_condition(self._api, self.pod, self.namespace, self.condition(loaded, reason, message), "ferry-load",
                      "the pod's ServiceAccount needs Ferry's weights-reporter ClusterRole in this namespace (the "
                      "operator binds it; see kubectl get rolebinding -l app.kubernetes.io/managed-by=ferry)")


def reporter_for(no_report: bool) -> Reporter:
    """The pod's condition when running in a serving pod Ferry wired, else nothing."""
    if no_report:
        return NoReport()
    pod = os.environ.get("POD_NAME")
    token_dir = Path(os.environ.get("FERRY_TOKEN_DIR", TOKEN_DIR))
    if not (token_dir / "token").is_file() and (STANDARD_TOKEN_DIR / "token").is_file():
        token_dir = STANDARD_TOKEN_DIR
    if not pod or not os.environ.get("KUBERNETES_SERVICE_HOST") or not (token_dir / "token").is_file():
        log.info("not in a pod Ferry wired (POD_NAME, the API server or a token missing): reporting nothing")
        return NoReport()
    return PodConditionReporter.connect(pod, token_dir)
