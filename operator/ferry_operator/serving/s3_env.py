"""The environment a serving pod's containers get to read an S3 store (the artifact, its compiled state).
Pure: secretKeyRef entries by named key, never a Secret's value, never envFrom."""
from __future__ import annotations

from typing import Any

from ..api.types import ModelWeightsSpec
from ..steps import SECRET_KEYS, s3_store_env

# Every name s3_env may set: Ferry's, wherever it finds them in a container it wired.
S3_ENV_NAMES = frozenset(SECRET_KEYS["store"]) | {"AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
                                                  "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING",
                                                  "AWS_EC2_METADATA_DISABLED"}


def s3_env(spec: ModelWeightsSpec) -> list[dict[str, Any]]:
    """Environment for streaming from S3 (runai_streamer, tensorizer, the loader's checks)."""
    s3 = spec.storage.s3 if spec.storage else None
    env = s3_store_env(s3, (s3.credentials_secret_ref if s3 else None) or spec.source.credentials_secret_ref)
    if s3 is not None and s3.endpoint:
        env += [
            # S3-compatible stores usually want path-style addressing.
            {"name": "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "value": "0"},
            # No instance metadata service to ask for credentials off AWS.
            {"name": "AWS_EC2_METADATA_DISABLED", "value": "true"},
        ]
    return env


# The S3 env names Ferry wrote into the serving container (comma-separated): tells Ferry's entries from a
# user's of the same name, so the ones Ferry no longer wants are deleted and the user's are never touched.
S3_ENV_ANNOTATION = "ferry.dev/s3-env"


def _first_by_name(env: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> its first entry (the one a strategic merge updates)."""
    out: dict[str, dict[str, Any]] = {}
    for e in env:
        if isinstance(e, dict) and isinstance(e.get("name"), str):
            out.setdefault(e["name"], e)
    return out


def env_current(have: list[dict[str, Any]], want: list[dict[str, Any]], owned: frozenset[str] | set[str]) -> bool:
    """Whether a container (as read) holds each of Ferry's entries `want`, and none of the names Ferry
    `owned` that it no longer wants."""
    held = _first_by_name(have)
    wanted = {e["name"] for e in want}
    return all(held.get(e["name"]) == e for e in want) and not any(n in held for n in set(owned) - wanted)


def env_patch(have: list[dict[str, Any]], want: list[dict[str, Any]],
              owned: frozenset[str] | set[str]) -> list[dict[str, Any]]:
    """The env entries of a container's strategic-merge patch that leave exactly `want` among the names Ferry
    `owned`: a delete for each one held and no longer wanted; each wanted entry, with the other of
    value/valueFrom nulled where the held entry of that name has it (a merge would keep both)."""
    held = _first_by_name(have)
    wanted = {e["name"] for e in want}
    out: list[dict[str, Any]] = [{"name": n, "$patch": "delete"} for n in sorted(set(owned) - wanted) if n in held]
    return out + [_replacing(held.get(e["name"], {}), e) for e in want]


def _replacing(held: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """`want` as a merge patch over `held` that leaves exactly `want`: every key of held's (value,
    valueFrom, and valueFrom's own: configMapKeyRef, fieldRef...) that want lacks is nulled; maps merge."""
    if held == want or not held:
        return want
    out: dict[str, Any] = {**want, **{k: None for k in ("value", "valueFrom") if k in held and k not in want}}
    if isinstance(held.get("valueFrom"), dict) and isinstance(want.get("valueFrom"), dict):
        out["valueFrom"] = {**want["valueFrom"], **{k: None for k in held["valueFrom"] if k not in want["valueFrom"]}}
    return out


def owned_names(annotation: str | None, legacy: frozenset[str]) -> frozenset[str]:
    """The S3 env names Ferry wrote into the serving container: its annotation's, else (a template Ferry
    wired before it recorded them) `legacy`."""
    if annotation is None:
        return legacy
    return frozenset(n for n in annotation.split(",") if n in S3_ENV_NAMES)
