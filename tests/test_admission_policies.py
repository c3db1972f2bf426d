"""The operator's check that Ferry's admission policies are enforced (fail closed), without a cluster."""
from __future__ import annotations

from ferry_operator.admission_policies import PolicyGuard, problems

POLICY = {"metadata": {"name": "ferry-references"}, "spec": {"failurePolicy": "Fail"}}


def binding(**spec):
    return {"spec": {"policyName": "ferry-references", "validationActions": ["Deny"], **spec}}


def test_an_enforced_policy_has_no_problems():
    assert problems(POLICY, [binding()], "ferry-references") == []


def test_missing_policy_binding_or_a_binding_that_does_not_deny_everywhere():
    assert problems(None, [binding()], "ferry-references") == ["ValidatingAdmissionPolicy ferry-references is missing"]
    for bindings in ([], [binding(validationActions=["Warn", "Audit"])],
                     [binding(matchResources={"namespaceSelector": {"matchLabels": {"x": "y"}}})],
                     [{"spec": {"policyName": "other", "validationActions": ["Deny"]}}]):
        (problem,) = problems(POLICY, bindings, "ferry-references")
        assert "no ValidatingAdmissionPolicyBinding enforces ferry-references everywhere" in problem
    ignoring = {"spec": {"failurePolicy": "Ignore"}}
    assert "failurePolicy Ignore" in problems(ignoring, [binding()], "ferry-references")[0]


class Api:
    """The two reads the guard makes, counted."""

    def __init__(self) -> None:
        self.policies = {"ferry-references": POLICY}
        self.reads = 0

    def read_validating_admission_policy(self, name, _preload_content):
        from kubernetes.client.exceptions import ApiException

        self.reads += 1
        if name not in self.policies:
            raise ApiException(status=404)
        return Response(self.policies[name])

    def list_validating_admission_policy_binding(self, _preload_content):
        return Response({"items": [binding()]})


class Response:
    def __init__(self, body):
        import json

        self.data = json.dumps(body).encode()


def test_the_guard_caches_an_enforced_check_and_looks_again_soon_after_a_failure():
    clock = [0.0]
    api = Api()
    guard = PolicyGuard(api, ["ferry-references"], interval_s=300, clock=lambda: clock[0])
    assert guard.problem() is None and guard.problem() is None and api.reads == 1
    del api.policies["ferry-references"]
    clock[0] = 299
    assert guard.problem() is None  # cached: one read per interval while all is well
    clock[0] = 300
    assert "ferry-references is missing" in guard.problem() and "helm install" in guard.problem()
    api.policies["ferry-references"] = POLICY
    clock[0] = 305  # a failure is checked again within seconds
    assert guard.problem() is None
