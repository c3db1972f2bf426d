"""Setting a condition on the worker's own pod: the one write a Ferry worker or
loader may make to the cluster.

Both a prepare Job's worker (ferry.dev/progress) and a serving pod's loader
(ferry.dev/weights-loaded) report this way, with their pod-bound service
account token. The chart's self-report admission policy lets such a token
change exactly one of Ferry's conditions, on its own pod, and nothing else.

The patch is a strategic merge patch of `status.conditions`, which merges by
`type`: the kubelet's conditions are left as they are.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

STANDARD_TOKEN_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


def connect(token_dir: Path) -> tuple[Any, str]:
    """(CoreV1Api authenticated by the token in `token_dir`, the pod's namespace)."""
    from kubernetes import client
    from kubernetes.config.incluster_config import InClusterConfigLoader

    configuration = client.Configuration()
    # Re-reads the token file as the kubelet rotates it.
    InClusterConfigLoader(token_filename=str(token_dir / "token"),
                          cert_filename=str(token_dir / "ca.crt")).load_and_set(configuration)
    namespace = (token_dir / "namespace").read_text().strip()
    return client.CoreV1Api(client.ApiClient(configuration)), namespace


def set_condition(core_api: Any, pod: str, namespace: str, condition: dict[str, Any], field_manager: str,
                  missing_grant: str) -> None:
    """Patch one condition of the pod's status; a denial is a PermissionError saying `missing_grant`."""
    from kubernetes.client.exceptions import ApiException

    try:
        core_api.patch_namespaced_pod_status(pod, namespace, {"status": {"conditions": [condition]}},
                                             field_manager=field_manager, _content_type=STRATEGIC_MERGE_PATCH)
    except ApiException as exc:
        if exc.status in (401, 403):
            raise PermissionError(
                f"cannot set condition {condition['type']} on pod {namespace}/{pod} ({exc.status} {exc.reason}: "
                f"{_message(exc)}): {missing_grant}") from None
        raise


def _message(exc: Any) -> str:
    try:
        return json.loads(exc.body).get("message", "")
    except (TypeError, ValueError, AttributeError):
        return str(exc.body or "")
