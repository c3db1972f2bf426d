"""Which worker steps prepare a ModelWeights, as data.

Each step is a `ferry` worker command over logical locations ({source},
{staging}, {artifact}) that an executor maps to real paths: a directory on the
operator's host (local executor) or a mount in a Job (Kubernetes executor).
A step's id carries a digest of the spec fields that shape its output, so a
spec change prepares a new artifact beside the old one instead of mutating it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from kubernetes.utils import parse_quantity

from .api.types import SECRET_KEYS, Format, FormatType, ModelWeightsSpec, S3Storage, SecretRef


class UnsupportedSpec(Exception):
    """The spec is valid but this build of Ferry cannot prepare it (yet)."""


@dataclass(frozen=True)
class Step:
    name: str  # fetch | shard | tensorize | publish
    argv: tuple[str, ...]  # `ferry` arguments; may contain {source}, {staging}, {artifact}
    digest: str

    @property
    def id(self) -> str:
        return f"{self.name}-{self.digest}"


# Format fields that shape the prepared bytes; the rest (e.g. tensorParallelSize
# of a plain safetensors copy) only change serving flags.
SHAPING_FORMAT_FIELDS = {
    FormatType.SAFETENSORS.value: set(),
    FormatType.SHARDED_STATE.value: {"tensor_parallel_size", "pipeline_parallel_size", "vllm_version", "max_part_size"},
    FormatType.TENSORIZER.value: {"tensor_parallel_size", "vllm_version", "tensorizer"},
    FormatType.RUNAI_STREAMER.value: set(),
    FormatType.RUNAI_STREAMER_SHARDED.value: {"tensor_parallel_size", "pipeline_parallel_size", "vllm_version",
                                              "max_part_size"},
}


# The format fields that say how a MoE model's experts are cut, at the defaults
# that cut them as Ferry did before the fields existed. Only a pre-cut
# artifact's bytes depend on them.
MOE_FORMAT_DEFAULTS = {"expert_parallel": False, "expert_placement": "linear", "target": "hopper"}


def pre_cut(fmt: Format) -> bool:
    """Whether the artifact holds per-rank files cut the way vLLM allocates the model
    (sharded_state; tensorizer's vllm layout), rather than the checkpoint's tensors."""
    if fmt.type == FormatType.TENSORIZER.value:
        return fmt.tensorizer is None or fmt.tensorizer.layout == "vllm"
    return fmt.type in (FormatType.SHARDED_STATE.value, FormatType.RUNAI_STREAMER_SHARDED.value)


def moe_shaping(fmt: Format) -> dict[str, object]:
    """The MoE fields that shape a pre-cut artifact, where they differ from their
    defaults (at the defaults an artifact is cut as before the fields existed, so
    its digest, and whether it is prepared again, must not change)."""
    if not pre_cut(fmt):
        return {}
    values = fmt.model_dump(mode="json", include=set(MOE_FORMAT_DEFAULTS))
    return {k: v for k, v in values.items() if v != MOE_FORMAT_DEFAULTS[k]}


def spec_digest(spec: ModelWeightsSpec) -> str:
    """Digest of what determines the artifact's bytes (not serving flags or deletion settings)."""
    fmt = spec.format
    shaping = {
        "source": spec.source.model_dump(mode="json", exclude={"credentials_secret_ref"}),
        "format": fmt.type,
        **fmt.model_dump(mode="json", include=SHAPING_FORMAT_FIELDS[fmt.type]),
        **moe_shaping(fmt),
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def moe_argv(fmt: Format) -> list[str]:
    """`ferry shard`/`tensorize --layout vllm` flags for the MoE fields, only where not at their defaults."""
    shaping = moe_shaping(fmt)
    argv = ["--expert-parallel"] if shaping.get("expert_parallel") else []
    if "expert_placement" in shaping:
        argv += ["--expert-placement", shaping["expert_placement"]]
    if "target" in shaping:
        argv += ["--target", shaping["target"]]
    return argv


def fetch_argv(spec: ModelWeightsSpec, output: str) -> tuple[str, ...]:
    argv = ["fetch", "--source", "{source}", "--output", output]
    if spec.source.revision:
        argv += ["--revision", spec.source.revision]
    for p in spec.source.allow_patterns:
        argv += ["--allow-pattern", p]
    for p in spec.source.ignore_patterns:
        argv += ["--ignore-pattern", p]
    return tuple(argv)


def secret_key_env(kind: str, secret: SecretRef) -> list[dict]:
    """The keys SECRET_KEYS[kind] of `secret` as container env: one secretKeyRef entry each (never a
    secret value, never the Secret whole: envFrom would set any variable the Secret names)."""
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": key, "optional": not required}}}
            for key, required in SECRET_KEYS[kind].items()]


def source_kind(uri: str) -> str:
    """The SECRET_KEYS kind of a source URI ("hf", "s3", "pvc"; "" for one no Job reads)."""
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    return scheme if scheme in SECRET_KEYS and scheme != "store" else ""


def s3_store_env(s3: S3Storage | None, secret: SecretRef | None) -> list[dict]:
    """A store's endpoint, region and credentials as container env: secretKeyRef
    entries (never a secret value), and env rather than envFrom, which merges by
    name in a strategic-merge patch."""
    env: list[dict] = secret_key_env("store", secret) if secret is not None else []
    if s3 is not None and s3.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": s3.endpoint})
    if s3 is not None and s3.region:
        env.append({"name": "AWS_DEFAULT_REGION", "value": s3.region})
    return env


def shard_argv(fmt: Format, source: str, output: str) -> tuple[str, ...]:
    return ("shard", "--source", source, "--output", output,
            "--tensor-parallel-size", str(fmt.tensor_parallel_size),
            "--pipeline-parallel-size", str(fmt.pipeline_parallel_size),
            "--vllm-version", fmt.vllm_version,
            "--max-part-size", str(int(parse_quantity(fmt.max_part_size))),
            *moe_argv(fmt))


def prepare_steps(spec: ModelWeightsSpec) -> list[Step]:
    """The ordered steps that turn the source into the artifact; empty if nothing is prepared."""
    digest = spec_digest(spec)
    fmt = spec.format
    if fmt.type == FormatType.SAFETENSORS.value:
        return [Step("fetch", fetch_argv(spec, "{artifact}"), digest)]
    if fmt.type == FormatType.SHARDED_STATE.value:
        return [Step("fetch", fetch_argv(spec, "{staging}"), digest), Step("shard", shard_argv(fmt, "{staging}",
                                                                                            "{artifact}"), digest)]
    if fmt.type == FormatType.RUNAI_STREAMER_SHARDED.value:
        # Cut on the claim beside the fetched checkpoint (both go with the staging directory once the artifact
        # is recorded), then the rank files and manifest published into storage.s3, which vLLM streams.
        checkpoint, cut = "{staging}/checkpoint", "{staging}/cut"
        return [Step("fetch", fetch_argv(spec, checkpoint), digest),
                Step("shard", shard_argv(fmt, checkpoint, cut), digest),
                Step("publish", ("publish", "--source", cut, "--output", "{artifact}"), digest)]
    if fmt.type == FormatType.TENSORIZER.value:
        options = fmt.tensorizer
        tensorize = [
            "tensorize", "--source", "{staging}", "--output", "{artifact}",
            "--layout", options.layout if options else "vllm",
            "--tensor-parallel-size", str(fmt.tensor_parallel_size),
            "--vllm-version", fmt.vllm_version,
            *moe_argv(fmt),  # none for the hf layout: vLLM cuts its tensors in load_weights
        ]
        if options is not None and options.encryption_secret_ref is not None:
            tensorize += ["--encryption-key-file", "{tensorizer_key}"]
        return [Step("fetch", fetch_argv(spec, "{staging}"), digest), Step("tensorize", tuple(tensorize), digest)]
    if fmt.type == FormatType.RUNAI_STREAMER.value and spec.storage and spec.storage.s3:
        # Published as HF-layout safetensors, which the streamer reads from S3.
        publish = ("publish", "--source", "{staging}", "--output", "{artifact}")
        return [Step("fetch", fetch_argv(spec, "{staging}"), digest), Step("publish", publish, digest)]
    if fmt.type == FormatType.RUNAI_STREAMER.value and spec.source.uri.startswith("s3://"):
        return []  # vLLM streams straight from the source bucket
    raise UnsupportedSpec(f"preparing format {fmt.type!r} from {spec.source.uri.split(':')[0]}:// is not implemented yet")
