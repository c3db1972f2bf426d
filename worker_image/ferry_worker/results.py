"""How a worker command ends: its exit status, and the step result the
executor reads ($FERRY_RESULT_FILE)."""
from __future__ import annotations

import os
from pathlib import Path

# Exit statuses. A prepare Job's podFailurePolicy fails the Job at once on
# EXIT_INPUT instead of retrying it (executors/jobs.py); argparse exits 2 on a
# usage error too.
EXIT_FAILED = 1  # may succeed on a retry: network, storage, a changed source, a crash
EXIT_INPUT = 2  # the source, the checkpoint or the arguments are wrong: the same command fails again

# Errors of huggingface_hub and S3 that are answers, not accidents (by class
# name / error code, so this module imports neither SDK).
_HUB_REFUSALS = {"RepositoryNotFoundError", "RevisionNotFoundError", "RemoteEntryNotFoundError", "DisabledRepoError"}
_S3_REFUSALS = {"NoSuchBucket", "InvalidBucketName", "AccessDenied", "AllAccessDisabled", "InvalidAccessKeyId",
                "SignatureDoesNotMatch"}


def is_input_error(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) says the input is wrong, so a retry would fail the same way."""
    from .fetch.selection import BadIndexError, NoWeightsError
    from .paths import UnsafePathError
    from .safetensors_header import UnsafeSafetensorsError
    from .shard.model import ShardError
    from .sources.base import BadSourceError
    from .tensorize.errors import ArtifactError

    deterministic = (BadSourceError, NoWeightsError, BadIndexError, UnsafePathError, UnsafeSafetensorsError, ShardError,
                     ArtifactError)
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, deterministic):
            return True
        if _HUB_REFUSALS & {c.__name__ for c in type(e).__mro__}:  # GatedRepoError is a RepositoryNotFoundError
            return True
        # botocore raises modeled errors (NoSuchBucket, ...) as ClientError subclasses.
        is_client_error = "ClientError" in {c.__name__ for c in type(e).__mro__}
        code = (getattr(e, "response", None) or {}).get("Error", {}).get("Code") if is_client_error else None
        if code in _S3_REFUSALS:
            return True
        e = e.__cause__
    return False


# Facts of a manifest's `extra` the operator records (a MoE artifact's: how its
# experts were cut); it refuses serving flags that the rank files cannot honour.
RESULT_FACTS = ("experts", "expertParallel", "target")


def step_result(directory: Path) -> dict:
    """What the operator learns about a finished step: the manifest's digest and size,
    and the RESULT_FACTS its extra holds (none for a dense model or a plain copy)."""
    from .manifest import manifest_digest, read_manifest

    manifest = read_manifest(directory)
    facts = {key: manifest.extra[key] for key in RESULT_FACTS if manifest.extra.get(key) is not None}
    return {"manifestDigest": manifest_digest(directory), "totalBytes": manifest.total_bytes,
            "files": len(manifest.files), **facts}


def report_result(text: str) -> None:
    """Write a step's result where the executor reads it ($FERRY_RESULT_FILE: a
    Job's termination log, or a file of the local executor); a no-op otherwise."""
    path = os.environ.get("FERRY_RESULT_FILE")
    if path:
        # The kubelet keeps at most 4 KiB of a termination message.
        Path(path).write_text(text[:4000])
