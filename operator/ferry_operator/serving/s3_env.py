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
