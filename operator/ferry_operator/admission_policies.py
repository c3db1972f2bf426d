"""Ferry's admission policies fail closed: the operator acts only while they are enforced.

Two ValidatingAdmissionPolicies carry Ferry's tenancy rules (the chart's
templates/admission.yaml and weights-reporter.yaml): every reference in a
spec authorised as the requesting user, and pods that may report only on
themselves. RBAC alone cannot say either, so without them the operator's
powers would be anyone's: a `helm template | kubectl apply` that skipped them,
an API server without ValidatingAdmissionPolicy, a binding in Warn or Audit
mode. The operator checks them before it starts, again after any watch event
of a policy or binding, and every `POLICY_CHECK_INTERVAL_S` (a slow resync);
while one is missing it starts no Job, patches no Deployment and binds no
role, and says what is missing.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable

# The chart sets the names of its release's policies; these are release "ferry"'s.
POLICIES_ENV = "FERRY_ADMISSION_POLICIES"
DEFAULT_POLICIES = "ferry-references,ferry-weights-reporter"
POLICY_CHECK_INTERVAL_S = float(os.environ.get("FERRY_POLICY_CHECK_INTERVAL", "300"))


def policy_names() -> list[str]:
    return [n.strip() for n in os.environ.get(POLICIES_ENV, DEFAULT_POLICIES).split(",") if n.strip()]


def problems(policy: dict[str, Any] | None, bindings: list[dict[str, Any]], name: str) -> list[str]:
    """What keeps policy `name` from being enforced everywhere, in words. Pure."""
    if policy is None:
        return [f"ValidatingAdmissionPolicy {name} is missing"]
    found = []
    if (policy.get("spec") or {}).get("failurePolicy", "Fail") != "Fail":
        found.append(f"ValidatingAdmissionPolicy {name} has failurePolicy Ignore (it must be Fail)")
    enforcing = [b for b in bindings
                 if (b.get("spec") or {}).get("policyName") == name
                 and "Deny" in ((b.get("spec") or {}).get("validationActions") or [])
                 and not (b.get("spec") or {}).get("matchResources")
                 and not (b.get("spec") or {}).get("paramRef")]
    if not enforcing:
        found.append(f"no ValidatingAdmissionPolicyBinding enforces {name} everywhere "
                     "(validationActions [Deny], no matchResources)")
    return found


def check(admission_api: Any, names: list[str]) -> str | None:
    """None while every policy is enforced; else what is missing and what to do."""
    from kubernetes.client.exceptions import ApiException

    def read(fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return json.loads(fn(*args, _preload_content=False).data)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    bindings = (read(admission_api.list_validating_admission_policy_binding) or {}).get("items") or []
    found = [p for name in names
             for p in problems(read(admission_api.read_validating_admission_policy, name), bindings, name)]
    if not found:
        return None
    return ("; ".join(found) + ". Ferry's tenancy rules live in these policies, so it does nothing without them: "
            "install the chart's templates/admission.yaml and templates/weights-reporter.yaml (helm install does), "
            f"or name the policies of your release in {POLICIES_ENV}")


class PolicyGuard:
    """`check`, cached for `interval_s`: what a reconcile asks before it acts."""

    def __init__(self, admission_api: Any, names: list[str], interval_s: float = POLICY_CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._api, self._names, self._interval_s, self._clock = admission_api, names, interval_s, clock
        self._lock = threading.Lock()
        self._checked_at: float | None = None
        self._problem: str | None = None

    def invalidate(self) -> None:
        """A policy or binding changed (a watch event): check again before the next action."""
        with self._lock:
            self._checked_at = None

    def problem(self) -> str | None:
        with self._lock:
            now = self._clock()
            # While one is missing, look again soon: the fix sends no event.
            interval = self._interval_s if self._problem is None else min(self._interval_s, 5.0)
            if self._checked_at is None or now - self._checked_at >= interval:
                self._problem = check(self._api, self._names)
                self._checked_at = now
            return self._problem
