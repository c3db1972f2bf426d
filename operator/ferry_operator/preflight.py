"""Before kopf starts: can this identity watch what the operator's indexes watch?

kopf feeds its indexes from list+watch; without the permission it retries in
the background and never runs a handler, so a missing grant would look like an
operator doing nothing. Checked up front with SelfSubjectAccessReviews, a
missing one stops the operator with a message that names it.
"""
from __future__ import annotations

from typing import Any

# (group, resource, why) the operator lists and watches.
WATCHED = [
    ("ferry.dev", "modelweights", "the objects it reconciles"),
    ("apps", "deployments", "the serving Deployments it wires"),
    ("batch", "jobs", "its prepare Jobs"),
    ("", "pods", "its prepare Jobs' pods and the serving pods' weights-loaded condition"),
]


def missing_permissions(authorization_api: Any, namespaces: list[str]) -> list[str]:
    from kubernetes import client

    problems = []
    for namespace in namespaces or [""]:
        for group, resource, why in WATCHED:
            for verb in ("list", "watch"):
                review = client.V1SelfSubjectAccessReview(spec=client.V1SelfSubjectAccessReviewSpec(
                    resource_attributes=client.V1ResourceAttributes(group=group, resource=resource, verb=verb,
                                                                    namespace=namespace or None)))
                if not authorization_api.create_self_subject_access_review(review).status.allowed:
                    where = f"in namespace {namespace}" if namespace else "cluster-wide"
                    what = f"{resource}.{group}" if group else resource
                    problems.append(f"may not {verb} {what} {where} (it watches {why})")
    return problems


def check(namespaces: list[str]) -> str | None:
    """None if every watch is allowed; else what to grant, in words."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    problems = missing_permissions(kubernetes.client.AuthorizationV1Api(), namespaces)
    if not problems:
        return None
    return ("the operator's identity " + "; ".join(problems)
            + ". Grant the chart's operator ClusterRole (charts/ferry/templates/rbac.yaml) to it.")
