"""Serving wiring: what Ferry writes into a vLLM Deployment. Pure.

Ferry owns a small set of vLLM flags in the chosen container's args and leaves
every other flag as the user wrote it. The artifact is mounted read-only at
/ferry/weights (PVC, or a hostPath for the local executor) or streamed from
S3, and the pod template carries the artifact's manifest digest, so a new
artifact — and only a new artifact or new flags — rolls the Deployment.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .api.types import Artifact, FormatType, ModelWeightsSpec

MOUNT_PATH = "/ferry/weights"
VOLUME_NAME = "ferry-weights"
DIGEST_ANNOTATION = "ferry.dev/artifact-digest"
OWNER_ANNOTATION = "ferry.dev/modelweights"

# Flags Ferry sets; any user value for them is replaced (aliases included).
MANAGED_FLAGS = {
    "--model": "--model",
    "--load-format": "--load-format",
    "--tensor-parallel-size": "--tensor-parallel-size",
    "-tp": "--tensor-parallel-size",
    "--pipeline-parallel-size": "--pipeline-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "--model-loader-extra-config": "--model-loader-extra-config",
}


class ServingError(Exception):
    """The Deployment cannot be wired as asked (e.g. the named container is missing)."""


@dataclass(frozen=True)
class DeploymentFacts:
    """What the handlers read from a Deployment."""

    name: str
    containers: dict[str, list[str]]  # container name -> args, in pod-spec order
    template_annotations: dict[str, str]
    rolled_out: bool  # the controller has observed the latest generation and every replica is updated and available


def strip_managed(args: list[str]) -> list[str]:
    """Remove Ferry-managed flags (`--flag value` and `--flag=value` forms)."""
    out: list[str] = []
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
            continue
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            skip_value = "=" not in arg
            continue
        out.append(arg)
    return out


def model_location(artifact_uri: str) -> str:
    """The --model value for an artifact: the mount for files, the URI for object stores."""
    if artifact_uri.startswith(("s3://", "gs://", "az://")):
        return artifact_uri.rstrip("/")
    return MOUNT_PATH


def ferry_args(spec: ModelWeightsSpec, artifact_uri: str) -> list[str]:
    fmt = spec.format
    args = [
        "--model", model_location(artifact_uri),
        "--load-format", fmt.type,
        "--tensor-parallel-size", str(fmt.tensor_parallel_size),
        "--pipeline-parallel-size", str(fmt.pipeline_parallel_size),
    ]
    if fmt.type == FormatType.RUNAI_STREAMER.value and fmt.runai_streamer is not None:
        extra = fmt.runai_streamer.model_dump(exclude_none=True)
        if extra:
            args += ["--model-loader-extra-config", json.dumps(extra, sort_keys=True)]
    return args


def volume_for(artifact_uri: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) that put the artifact at MOUNT_PATH; None for object stores."""
    if artifact_uri.startswith("pvc://"):
        claim, _, sub_path = artifact_uri.removeprefix("pvc://").partition("/")
        mount = {"name": VOLUME_NAME, "mountPath": MOUNT_PATH, "readOnly": True}
        if sub_path:
            mount["subPath"] = sub_path
        return {"name": VOLUME_NAME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}, mount
    if artifact_uri.startswith("file://"):
        volume = {"name": VOLUME_NAME, "hostPath": {"path": artifact_uri.removeprefix("file://"), "type": "Directory"}}
        return volume, {"name": VOLUME_NAME, "mountPath": MOUNT_PATH, "readOnly": True}
    return None


def s3_env(spec: ModelWeightsSpec) -> list[dict[str, Any]]:
    """Environment for streaming from S3 (runai_streamer).

    Credentials are env entries with secretKeyRef, not envFrom: env merges by
    name in a strategic-merge patch, envFrom would replace the user's list.
    """
    env: list[dict[str, Any]] = []
    s3 = spec.storage.s3 if spec.storage else None
    secret = (s3.credentials_secret_ref if s3 else None) or spec.source.credentials_secret_ref
    if secret is not None:
        for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                              ("AWS_SESSION_TOKEN", True)):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": key,
                                                                    "optional": optional}}})
    if s3 is not None and s3.endpoint:
        env += [
            {"name": "AWS_ENDPOINT_URL", "value": s3.endpoint},
            # S3-compatible stores usually want path-style addressing.
            {"name": "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "value": "0"},
        ]
    if s3 is not None and s3.region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": s3.region})
    return env


def deployment_patch(
    spec: ModelWeightsSpec, mw_name: str, artifact: Artifact, container: str | None, current: DeploymentFacts,
) -> dict[str, Any] | None:
    """The strategic-merge patch that wires `current` to the artifact; None if already wired."""
    if not current.containers:
        raise ServingError(f"deployment {current.name} has no containers")
    name = container or next(iter(current.containers))
    if name not in current.containers:
        raise ServingError(
            f"deployment {current.name} has no container {name!r} (has: {', '.join(current.containers)})"
        )
    args = strip_managed(current.containers[name]) + ferry_args(spec, artifact.uri)
    digest = artifact.manifest_digest or artifact.uri
    if args == current.containers[name] and current.template_annotations.get(DIGEST_ANNOTATION) == digest:
        return None
    c: dict[str, Any] = {"name": name, "args": args}
    pod: dict[str, Any] = {"containers": [c]}
    mounted = volume_for(artifact.uri)
    if mounted is not None:
        volume, mount = mounted
        pod["volumes"] = [volume]
        c["volumeMounts"] = [mount]
    elif env := s3_env(spec):
        c["env"] = env
    return {"spec": {"template": {
        "metadata": {"annotations": {DIGEST_ANNOTATION: digest, OWNER_ANNOTATION: mw_name}},
        "spec": pod,
    }}}
