"""The ModelWeights API (ferry.dev/v1alpha1): the single source of truth.

The CRD in crds/ is generated from these models (`make crds`); descriptions
here are what `kubectl explain` shows. Cross-field constraints are `Rule`s:
CEL at admission, the same check in Python when the operator parses a spec.
"""
from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from .rules import Rule, crd_validations, enforce, matches, rule_error

GROUP = "ferry.dev"
VERSION = "v1alpha1"
KIND = "ModelWeights"
PLURAL = "modelweights"
SINGULAR = "modelweights"
SHORT_NAMES = ["mw"]
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes naming and quantity grammars (apimachinery's validation).
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
QUANTITY = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"

ResourceName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN)]
ContainerName = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS1123_LABEL)]
Quantity = Annotated[str, Field(max_length=64, pattern=QUANTITY)]
GlobPattern = Annotated[
    str, Field(min_length=1, max_length=256, description="A glob over paths in the source, e.g. *.safetensors.")
]


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", use_enum_values=True,
        validate_default=True,
    )


class SecretRef(Model):
    """A Secret in the ModelWeights' namespace."""

    name: ResourceName = Field(description="Name of the Secret.")


# --- credentials ---------------------------------------------------------------

# The keys of a credentials Secret that reach a worker, per kind of store, each as its own env entry
# (secretKeyRef; True: required, so a missing Secret or key stops the pod with a message the operator
# reports). Every other key of the Secret is ignored: a Secret is never imported whole (envFrom), so a
# key named PYTHONPATH or LD_PRELOAD sets nothing. One table: the Jobs, the CRD's descriptions and
# docs/api.md follow it.
S3_CREDENTIAL_KEYS = {"AWS_ACCESS_KEY_ID": True, "AWS_SECRET_ACCESS_KEY": True, "AWS_SESSION_TOKEN": False}
# A source's way out of a cluster: its proxy (for its own traffic, with its own credentials).
PROXY_KEYS = {"HTTPS_PROXY": False, "HTTP_PROXY": False, "NO_PROXY": False}
SECRET_KEYS: dict[str, dict[str, bool]] = {
    # huggingface_hub's token, and its endpoint (a mirror or proxy) and CA bundle.
    "hf": {"HF_TOKEN": True, "HF_ENDPOINT": False, "REQUESTS_CA_BUNDLE": False, **PROXY_KEYS},
    # An s3:// source has no endpoint or region field: they may come from its Secret.
    "s3": {**S3_CREDENTIAL_KEYS, "AWS_ENDPOINT_URL": False, "AWS_ENDPOINT_URL_S3": False, "AWS_REGION": False,
           "AWS_DEFAULT_REGION": False, "AWS_CA_BUNDLE": False, **PROXY_KEYS},
    "pvc": {},
    # storage.s3: its endpoint and region are fields of its own.
    "store": dict(S3_CREDENTIAL_KEYS),
}


def secret_keys_text(kind: str) -> str:
    """The keys of SECRET_KEYS[kind] for humans: "A, B (optional: C)"."""
    keys = SECRET_KEYS[kind]
    required = ", ".join(k for k, needed in keys.items() if needed)
    optional = ", ".join(k for k, needed in keys.items() if not needed)
    return f"{required} (optional: {optional})" if optional else required


# --- source -------------------------------------------------------------------

SOURCE_URI_RULES = [
    matches(
        r"^(hf|s3|pvc|file)://",
        "must start with hf://, s3://, pvc:// or file://",
    ),
    matches(
        r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$",
        "hf:// URIs name a Hub repository: hf://org/name",
        unless_prefix="hf://",
    ),
    matches(
        r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$",
        "s3:// URIs look like s3://bucket/prefix (bucket: 3-63 lowercase letters, digits, dots, hyphens)",
        unless_prefix="s3://",
    ),
    matches(
        r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?$",
        "pvc:// URIs look like pvc://claim-name/path (claim: a DNS-1123 label)",
        unless_prefix="pvc://",
    ),
    matches(r"^file:///", "file:// URIs need an absolute path: file:///path", unless_prefix="file://"),
    Rule(
        "!self.matches('(^|/)\\\\.\\\\.(/|$)')",
        "must not contain '..' path segments",
        lambda v: ".." not in v.split("/"),
    ),
]


class Source(Model):
    """Where the original weights come from."""

    uri: str = Field(
        max_length=2048,
        description=(
            "Location of the original checkpoint: hf://org/name (Hugging Face Hub), "
            "s3://bucket/prefix, pvc://claim/path (a PersistentVolumeClaim in this namespace), "
            "or file:///path (local executor only)."
        ),
        json_schema_extra=crd_validations(SOURCE_URI_RULES),
    )
    revision: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="Hub branch, tag or commit (hf:// only; default: main).",
    )
    credentials_secret_ref: SecretRef | None = Field(
        None,
        description=(
            f"Secret with the source's credentials. The fetch step gets these keys only, each by name: "
            f"{secret_keys_text('hf')} for hf://; {secret_keys_text('s3')} for s3://. "
            "Any other key is ignored (never imported into a pod's environment)."
        ),
    )
    allow_patterns: list[GlobPattern] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "Glob patterns of files to fetch. Empty: vLLM's rules (safetensors preferred over "
            ".bin over .pt; only files the safetensors index references; config, generation "
            "config and tokenizer files always)."
        ),
    )
    ignore_patterns: list[GlobPattern] = Field(
        default_factory=list,
        max_length=64,
        description="Glob patterns of files to skip, on top of vLLM's defaults (original/**, training artifacts).",
    )

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        return enforce(SOURCE_URI_RULES, v)


# --- storage ------------------------------------------------------------------


class AccessMode(str, Enum):
    """A PersistentVolumeClaim access mode."""

    READ_WRITE_ONCE = "ReadWriteOnce"
    READ_ONLY_MANY = "ReadOnlyMany"
    READ_WRITE_MANY = "ReadWriteMany"
    READ_WRITE_ONCE_POD = "ReadWriteOncePod"


PVC_RULES = [
    Rule(
        "has(self.name) || has(self.size)",
        "set name (reuse an existing claim) or size (Ferry creates the claim)",
        lambda p: p.name is not None or p.size is not None,
    ),
]


class PVCStorage(Model):
    """A PersistentVolumeClaim that holds prepared artifacts and serving pods mount read-only."""

    model_config = ConfigDict(json_schema_extra=crd_validations(PVC_RULES))

    name: ResourceName | None = Field(
        None,
        description="Claim name. With size unset, an existing claim is reused; default: <modelweights-name>-weights.",
    )
    size: Quantity | None = Field(
        None, description="Requested capacity (a Kubernetes quantity, e.g. 200Gi); Ferry creates the claim if absent."
    )
    storage_class_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS1123_SUBDOMAIN,
        description="StorageClass of a created claim; immutable once set.",
        json_schema_extra=crd_validations(
            [Rule("self == oldSelf", "storageClassName is immutable", lambda v: True)]
        ),
    )
    access_modes: list[AccessMode] = Field(
        default_factory=lambda: [AccessMode.READ_WRITE_ONCE],
        min_length=1,
        max_length=4,
        description="Access modes of a created claim. Serving pods on several nodes need ReadOnlyMany or ReadWriteMany.",
        json_schema_extra={"default": ["ReadWriteOnce"]},
    )
    sub_path: str | None = Field(
        None,
        max_length=1024,
        pattern=r"^[^/]",
        description="Directory inside the claim for this model's artifacts (relative); default: the ModelWeights name.",
        json_schema_extra=crd_validations(
            [Rule("!self.matches('(^|/)\\\\.\\\\.(/|$)')", "must not contain '..' path segments", lambda v: ".." not in v.split("/"))]
        ),
    )

    @model_validator(mode="after")
    def _rules(self) -> "PVCStorage":
        return enforce(PVC_RULES, self)


ENDPOINT_RULES = [
    matches(
        r"^https?://[^/@]+(/.*)?$",
        "must not carry credentials (user:password@host): they would be written into the pods' plain env; "
        "put them in the Secret named by credentialsSecretRef",
    ),
]


class S3Storage(Model):
    """An S3 (or S3-compatible) prefix for artifacts."""

    uri: str = Field(
        max_length=2048,
        pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$",
        description="Destination prefix: s3://bucket/prefix.",
    )
    endpoint: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^https?://[^\s/]+(/.*)?$",
        description="Endpoint URL of an S3-compatible store (e.g. http://minio.storage:9000); default: AWS. No "
                    "credentials in it: they would land in plain env; use credentialsSecretRef.",
        json_schema_extra=crd_validations(ENDPOINT_RULES),
    )

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        return v if v is None else enforce(ENDPOINT_RULES, v)
    region: str | None = Field(None, max_length=64, pattern=r"^[a-z0-9-]+$", description="Bucket region.")
    credentials_secret_ref: SecretRef | None = Field(
        None, description=f"Secret with this store's credentials: the keys {secret_keys_text('store')}, each by "
                          "name; any other key is ignored."
    )


class Storage(Model):
    """Where prepared artifacts live: a PVC, an S3 prefix, or both."""

    pvc: PVCStorage | None = Field(None, description="PersistentVolumeClaim for artifacts.")
    s3: S3Storage | None = Field(None, description="S3 prefix for artifacts.")


# --- format -------------------------------------------------------------------


class FormatType(str, Enum):
    """A vLLM load format."""

    SAFETENSORS = "safetensors"
    SHARDED_STATE = "sharded_state"
    TENSORIZER = "tensorizer"
    RUNAI_STREAMER = "runai_streamer"
    RUNAI_STREAMER_SHARDED = "runai_streamer_sharded"


class ExpertPlacement(str, Enum):
    """How vLLM places a MoE layer's experts on the expert-parallel ranks (--expert-placement-strategy)."""

    LINEAR = "linear"
    ROUND_ROBIN = "round_robin"


class GpuTarget(str, Enum):
    """The GPU family the serving pods run on."""

    HOPPER = "hopper"
    AMPERE = "ampere"
    ADA = "ada"
    BLACKWELL = "blackwell"
    ROCM = "rocm"


class TensorizerOptions(Model):
    """Options of the tensorizer format."""

    encryption_secret_ref: SecretRef | None = Field(
        None, description="Secret with key `key` holding a tensorizer encryption key; artifacts are encrypted at rest."
    )
    num_readers: int | None = Field(
        None, ge=1, le=64, description="Parallel readers when deserializing (vLLM TensorizerConfig.num_readers)."
    )
    layout: Literal["vllm", "hf"] = Field(
        "vllm",
        description="vllm: one file per tensor-parallel rank with vLLM's own names and shapes (vLLM builds the model "
                    "on the meta device and loads each rank's file straight into it; cut on CPU, no GPU needed). "
                    "hf: one model.tensors with the checkpoint's names, loaded through the model's load_weights.",
    )


class RunaiStreamerOptions(Model):
    """Tuning of the Run:ai Model Streamer (vLLM --model-loader-extra-config)."""

    concurrency: int | None = Field(None, ge=1, le=256, description="Concurrent reads (default 16 file / 8 object store).")
    memory_limit: int | None = Field(
        None, ge=-1, description="CPU staging buffer limit in bytes; -1 is unlimited."
    )


FORMAT_RULES = [
    Rule(
        # has(): the API server also checks rules against the schema's own default ({} for format).
        "!has(self.type) || self.type != 'runai_streamer_sharded' || !has(self.vllmVersion)"
        " || int(self.vllmVersion.split('.')[0]) > 0 || int(self.vllmVersion.split('.')[1]) >= 32",
        "runai_streamer_sharded needs vllmVersion >= 0.32 (Ferry proves it against vLLM 0.32; earlier releases "
        "read the rank files' S3 names wrongly)",
        lambda f: f.type != FormatType.RUNAI_STREAMER_SHARDED.value or _version_at_least(f.vllm_version, (0, 32)),
        ".vllmVersion",
    ),
    Rule(
        "!has(self.tensorizer) || self.type == 'tensorizer'",
        "only valid when format.type is tensorizer",
        lambda f: f.tensorizer is None or f.type == FormatType.TENSORIZER.value,
        ".tensorizer",
    ),
    Rule(
        "!has(self.runaiStreamer) || self.type == 'runai_streamer'",
        "only valid when format.type is runai_streamer (vLLM's sharded loader, which runai_streamer_sharded "
        "uses, takes no streamer options)",
        lambda f: f.runai_streamer is None or f.type == FormatType.RUNAI_STREAMER.value,
        ".runaiStreamer",
    ),
    Rule(
        # has(): the API server also checks rules against the schema's own default ({} for format).
        "!has(self.expertParallel) || !self.expertParallel || (has(self.tensorParallelSize) && self.tensorParallelSize > 1)",
        "expertParallel needs tensorParallelSize > 1: vLLM's expert-parallel size is the tensor-parallel size "
        "here, and with one rank there is nothing to spread the experts over",
        lambda f: not f.expert_parallel or f.tensor_parallel_size > 1,
        ".expertParallel",
    ),
    Rule(
        "!has(self.expertPlacement) || self.expertPlacement == 'linear' || (has(self.expertParallel) && self.expertParallel)",
        "expertPlacement other than linear needs expertParallel: without expert parallelism every rank holds "
        "a slice of every expert, so there is nothing to place",
        lambda f: f.expert_placement == ExpertPlacement.LINEAR.value or f.expert_parallel,
        ".expertPlacement",
    ),
]


class Format(Model):
    """The vLLM load format to prepare and serve, and the parallelism it is cut for."""

    model_config = ConfigDict(json_schema_extra=crd_validations(FORMAT_RULES))

    type: FormatType = Field(
        FormatType.SAFETENSORS,
        description=(
            "vLLM --load-format. safetensors: plain copy into a PVC. sharded_state: pre-cut "
            "per tensor-parallel rank into a PVC, each rank reads only its shard. tensorizer: "
            "serialized into S3 and streamed. runai_streamer: safetensors streamed concurrently "
            "from S3 at load time. runai_streamer_sharded: cut as sharded_state, published to storage.s3, "
            "each rank streaming only its own files."
        ),
    )
    tensor_parallel_size: int = Field(1, ge=1, le=512, description="vLLM --tensor-parallel-size.")
    pipeline_parallel_size: int = Field(1, ge=1, le=128, description="vLLM --pipeline-parallel-size.")
    vllm_version: str = Field(
        "0.32",
        max_length=32,
        pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?$",
        description="vLLM version the serving pods run (major.minor[.patch]); sharded_state layouts differ by version.",
    )
    max_part_size: Quantity = Field(
        "5Gi", description="sharded_state: largest file per part (vLLM's default is 5 GiB)."
    )
    expert_parallel: bool = Field(
        False,
        strict=True,  # as the API server: "yes" is not a boolean
        description="MoE models: serve with vLLM --enable-expert-parallel, each tensor-parallel rank holding whole "
                    "experts (expert-parallel size = tensorParallelSize; needs it > 1). sharded_state and "
                    "tensorizer (vllm layout) artifacts are cut that way; for the other formats it is only the "
                    "serving flag.",
    )
    expert_placement: ExpertPlacement = Field(
        ExpertPlacement.LINEAR,
        description="With expertParallel: vLLM --expert-placement-strategy. linear: contiguous experts per rank; "
                    "round_robin: expert e on rank e mod size (vLLM honours it only for models with expert groups).",
    )
    target: GpuTarget = Field(
        GpuTarget.HOPPER,
        description="GPU family of the serving pods. vLLM's MoE kernels on some of them allocate padded expert "
                    "shapes (FlashInfer TRT-LLM on blackwell, AITER on rocm), which pre-cut artifacts (sharded_state, "
                    "tensorizer vllm layout) must match; a combination Ferry cannot know is refused when preparing.",
    )
    tensorizer: TensorizerOptions | None = Field(None, description="tensorizer options.")
    runai_streamer: RunaiStreamerOptions | None = Field(None, description="Run:ai Model Streamer options.")

    @model_validator(mode="after")
    def _rules(self) -> "Format":
        return enforce(FORMAT_RULES, self)


# --- serving ------------------------------------------------------------------


class DeploymentRef(Model):
    """A serving Deployment in this namespace that Ferry wires to the artifact."""

    name: ResourceName = Field(description="Deployment name.")
    container: ContainerName | None = Field(
        None, description="Container running vLLM; default: the first container."
    )


class WorkloadKind(str, Enum):
    """The kinds of serving workload Ferry wires."""

    DEPLOYMENT = "Deployment"
    STATEFUL_SET = "StatefulSet"
    LEADER_WORKER_SET = "LeaderWorkerSet"  # kubernetes-sigs/lws, leaderworkerset.x-k8s.io/v1


MAX_GROUP_SIZE = 64
# Workloads serving may name, deployments and targets together. The references admission policy checks each
# as the requesting user, and each authorizer check costs 350,000 of the API server's CEL budget of 10,000,000
# per policy and request: 20 workloads and the spec's other references (Secrets, claims) fit, 32 did not
# (tests/test_reference_admission.py, against the real API server).
MAX_WORKLOADS = 20


def target_key(kind: str, name: str) -> str:
    """How the operator files a serving workload: a Deployment by its name (as serving.deployments always
    has), others as kubectl names them (statefulset/NAME, leaderworkerset/NAME)."""
    return name if kind == WorkloadKind.DEPLOYMENT.value else f"{kind.lower()}/{name}"

TARGET_RULES = [
    Rule(
        "self.kind != 'Deployment' || !has(self.groupSize) || self.groupSize == 1",
        "a Deployment's pods are interchangeable, each serving the whole TP x PP group: groupSize must be 1 "
        "(use a LeaderWorkerSet or a StatefulSet for a group spread over several pods)",
        lambda t: t.kind != WorkloadKind.DEPLOYMENT.value or t.group_size in (None, 1),
        ".groupSize",
    ),
]


class ServingTarget(Model):
    """A serving workload in this namespace that Ferry wires to the artifact."""

    model_config = ConfigDict(json_schema_extra=crd_validations(TARGET_RULES))

    kind: WorkloadKind = Field(
        WorkloadKind.DEPLOYMENT,
        description="Deployment (every pod serves the whole TP x PP group), StatefulSet or LeaderWorkerSet "
                    "(leaderworkerset.x-k8s.io/v1: its leader and worker templates are both wired).",
    )
    name: ResourceName = Field(description="The workload's name.")
    container: ContainerName | None = Field(
        None, description="Container running vLLM; default: the first container."
    )
    group_size: int | None = Field(
        None, ge=1, le=MAX_GROUP_SIZE,
        description="Pods that serve one TP x PP group together (a LeaderWorkerSet's leaderWorkerTemplate.size; "
                    "a StatefulSet's replicas when its pods form one vLLM instance). Pod i of a group loads and "
                    "verifies only its slice of the ranks, [i*k, (i+1)*k) with k = TP x PP / groupSize (vLLM's "
                    "--node-rank order: with groupSize = PP, one pipeline stage per pod), and vLLM gets "
                    "--nnodes/--node-rank. Must divide TP x PP and equal the workload's own group size. "
                    "Default 1: each pod serves the whole group.",
    )

    @model_validator(mode="after")
    def _rules(self) -> "ServingTarget":
        return enforce(TARGET_RULES, self)

    @property
    def pods_per_group(self) -> int:
        return self.group_size or 1

    @property
    def key(self) -> str:
        return target_key(self.kind, self.name)

    def describe(self) -> str:
        return f"{self.kind.lower()} {self.name}"


def _first_duplicate(refs: list) -> int | None:
    seen: set[tuple[str, str]] = set()
    for i, d in enumerate(refs):
        key = (getattr(d, "kind", WorkloadKind.DEPLOYMENT.value), d.name)
        if key in seen:
            return i
        seen.add(key)
    return None


class NodeCachePrewarm(Model):
    """Nodes to fill before the serving Deployments roll onto a new artifact."""

    node_selector: dict[str, str] = Field(
        min_length=1, max_length=16,
        description="Labels of the nodes to fill (e.g. a GPU pool's), as a pod's nodeSelector reads them.",
    )
    wait: bool = Field(
        True,
        description="Patch the Deployments only once every selected node holds the artifact, so a rollout "
                    "reads node disk only; false: fill them alongside the rollout.",
    )


class NodeCache(Model):
    """Serve the artifact from node-local disk through the chart's node cache agent (nodeCache.enabled)."""

    enabled: bool = Field(
        False,
        description="Serving pods mount the artifact read-only from the node they run on (the CSI driver "
                    "cache.ferry.dev) instead of the claim; the operator runs one fill Job per node that needs "
                    "it, which reads the claim with the worker's rights, and the agent verifies every byte "
                    "before any pod mounts it.",
    )
    prewarm: NodeCachePrewarm | None = Field(None, description="Fill selected nodes before the rollout.")


class RolloutStrategy(str, Enum):
    """How the rollouts Ferry triggers replace a Deployment's pods."""

    WORKLOAD = "Workload"  # by the Deployment's own strategy
    IN_PLACE = "InPlace"  # one old pod at a time is removed before its replacement is made


class Rollout(Model):
    """How Ferry's rollouts replace pods."""

    strategy: RolloutStrategy = Field(
        RolloutStrategy.WORKLOAD,
        description="Workload: each workload rolls by its own strategy. InPlace: while a rollout Ferry started "
                    "runs on a Deployment whose strategy surges, Ferry sets maxSurge 0 and maxUnavailable 1, so "
                    "the new pod takes the room its old pod frees (a full GPU pool has no room for a surge pod), "
                    "and puts the Deployment's own strategy back once the rollout completes (it keeps it in the "
                    "annotation ferry.dev/rollout-strategy meanwhile). StatefulSets and LeaderWorkerSets roll "
                    "without surging already and are left alone.",
    )


class CompiledStateMode(str, Enum):
    OFF = "Off"
    AFTER_FIRST_READY = "AfterFirstReady"
    BEFORE_ROLLOUT = "BeforeRollout"


class CompiledState(Model):
    """vLLM's compiled state (its VLLM_CACHE_ROOT: Dynamo, Inductor and Triton caches) kept once per
    configuration and handed to every later pod, so they start without compiling."""

    mode: CompiledStateMode = Field(
        CompiledStateMode.OFF,
        description="AfterFirstReady: the first wired pod of a configuration to answer /health keeps what vLLM "
                    "compiled (a sidecar publishes it on the artifact's claim, under this object's uid); every "
                    "later pod of the same configuration (weights, image, command line, device kind) has it "
                    "restored, verified, by its loader before vLLM starts. BeforeRollout: before Ferry rolls a "
                    "Deployment to a new configuration, a warm-up Job runs one pod of the wired template (same "
                    "image, flags, account, placement and requests) until vLLM answers /health and keeps its "
                    "state; the rollout follows, so every replica starts warm. It needs room for one more pod: "
                    "while it cannot be scheduled the status says so; if it fails, the rollout goes on as with "
                    "AfterFirstReady. Both need readinessGate and an artifact on a claim. Off: vLLM compiles in "
                    "every pod.",
    )


SERVING_RULES = [
    Rule(
        "(has(self.deployments) ? size(self.deployments) : 0) + (has(self.targets) ? size(self.targets) : 0)"
        f" <= {MAX_WORKLOADS}",
        f"at most {MAX_WORKLOADS} workloads in deployments and targets together",
        lambda s: len(s.deployments) + len(s.targets) <= MAX_WORKLOADS,
        ".targets",
    ),
    Rule(
        "!has(self.targets) || !has(self.deployments)"
        " || self.targets.all(t, t.kind != 'Deployment' || !self.deployments.exists(d, d.name == t.name))",
        "a Deployment is listed in both deployments and targets: list it once",
        lambda s: not ({d.name for d in s.deployments}
                       & {t.name for t in s.targets if t.kind == WorkloadKind.DEPLOYMENT.value}),
        ".targets",
    ),
    Rule(
        "!(has(self.nodeCache) && self.nodeCache.enabled && self.localCopy)",
        "nodeCache and localCopy both serve the weights from node disk: use one",
        lambda s: not (s.node_cache and s.node_cache.enabled and s.local_copy),
        ".nodeCache",
    ),
    Rule(
        "!self.localCopy || self.readinessGate",
        "localCopy needs readinessGate: the loader makes the copy",
        lambda s: not s.local_copy or s.readiness_gate,
        ".localCopy",
    ),
]


class Serving(Model):
    """Workloads to patch with --model, --load-format and flags, and roll on change."""

    model_config = ConfigDict(json_schema_extra=crd_validations(SERVING_RULES))

    deployments: list[DeploymentRef] = Field(
        default_factory=list,
        max_length=MAX_WORKLOADS,
        description="Deployments to wire; each is rolled when the artifact changes (the same as targets of "
                    "kind Deployment).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    targets: list[ServingTarget] = Field(
        default_factory=list,
        max_length=MAX_WORKLOADS,
        description="Workloads to wire, of any kind (Deployment, StatefulSet, LeaderWorkerSet); each is rolled "
                    "when the artifact changes (a LeaderWorkerSet as whole groups, by its own rolling update).",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["kind", "name"]},
    )

    @field_validator("deployments", "targets")
    @classmethod
    def _unique(cls, refs: list) -> list:
        # The API server enforces this through x-kubernetes-list-type: map;
        # report it on the same element as it does.
        dup = _first_duplicate(refs)
        if dup is not None:
            raise rule_error(f"Duplicate value: {refs[dup].name!r}", f"[{dup}]")
        return refs

    def workloads(self) -> list[ServingTarget]:
        """Every workload to wire: serving.deployments (as targets of kind Deployment), then serving.targets."""
        return [ServingTarget(name=d.name, container=d.container) for d in self.deployments] + list(self.targets)

    readiness_gate: bool = Field(
        True,
        description="Add Ferry's loader (an init container that verifies the pod's files against the manifest and "
                    "reads them into the page cache) and a pod readiness gate that turns true only once it has.",
    )
    local_copy: bool = Field(
        False,
        description="The loader also copies the pod's files to node-local disk (an emptyDir) and vLLM loads them "
                    "from there: for network filesystems slower than local disk. Needs readinessGate.",
    )
    node_cache: NodeCache | None = Field(
        None, description="Serve from a verified copy on each node's own disk, filled once per node and digest.")
    rollout: Rollout = Field(default_factory=Rollout,
                             description="How the rollouts Ferry triggers replace the Deployments' pods.")
    compiled_state: CompiledState = Field(
        default_factory=CompiledState, description="Keep vLLM's compiled state and restore it into later pods.")

    @model_validator(mode="after")
    def _rules(self) -> "Serving":
        return enforce(SERVING_RULES, self)


# --- spec ---------------------------------------------------------------------


class DeletionPolicy(str, Enum):
    """What happens to prepared data when the ModelWeights is deleted."""

    RETAIN = "Retain"
    DELETE = "Delete"


def _node_cache(s: "ModelWeightsSpec") -> bool:
    return bool(s.serving and s.serving.node_cache and s.serving.node_cache.enabled)


def _has_pvc(s: "ModelWeightsSpec") -> bool:
    return s.storage is not None and s.storage.pvc is not None


def _has_s3(s: "ModelWeightsSpec") -> bool:
    return s.storage is not None and s.storage.s3 is not None


def _world(s: "ModelWeightsSpec") -> int:
    return s.format.tensor_parallel_size * s.format.pipeline_parallel_size


SPEC_RULES = [
    Rule(
        "!has(self.serving) || !has(self.serving.targets) || self.serving.targets.all(t, !has(t.groupSize)"
        " || (self.format.tensorParallelSize * self.format.pipelineParallelSize) % t.groupSize == 0)",
        "groupSize must divide format.tensorParallelSize x format.pipelineParallelSize: each pod of a group "
        "serves an equal slice of the ranks (vLLM's --nnodes must divide its world size)",
        lambda s: not s.serving or all(_world(s) % t.pods_per_group == 0 for t in s.serving.targets),
        ".serving.targets",
    ),
    Rule(
        "!(has(self.serving) && has(self.serving.nodeCache) && self.serving.nodeCache.enabled)"
        " || self.format.type in ['safetensors', 'sharded_state', 'runai_streamer_sharded']"
        " || (self.format.type == 'runai_streamer' && has(self.storage) && has(self.storage.s3))",
        "the node cache is filled from the artifact Ferry prepared, on its claim or in its storage.s3 prefix: "
        "format.type must be safetensors, sharded_state or runai_streamer_sharded, or runai_streamer with "
        "storage.s3 (runai_streamer streaming straight from the source bucket has no prepared artifact; "
        "tensorizer is not cached on nodes)",
        lambda s: not _node_cache(s) or s.format.type in (FormatType.SAFETENSORS.value,
                                                           FormatType.SHARDED_STATE.value,
                                                           FormatType.RUNAI_STREAMER_SHARDED.value)
        or (s.format.type == FormatType.RUNAI_STREAMER.value and _has_s3(s)),
        ".serving.nodeCache",
    ),
    Rule(
        "self.format.type != 'tensorizer' || (has(self.storage) && has(self.storage.s3))",
        "required when format.type is tensorizer (tensorized artifacts are written to S3)",
        lambda s: s.format.type != FormatType.TENSORIZER.value or _has_s3(s),
        ".storage.s3",
    ),
    Rule(
        "self.format.type != 'runai_streamer_sharded' || (has(self.storage) && has(self.storage.s3))",
        "required when format.type is runai_streamer_sharded (the rank files are published to storage.s3, "
        "which vLLM streams them from; for rank files on a claim use sharded_state)",
        lambda s: s.format.type != FormatType.RUNAI_STREAMER_SHARDED.value or _has_s3(s),
        ".storage.s3",
    ),
    Rule(
        "!(self.format.type in ['tensorizer', 'runai_streamer_sharded'] || (self.format.type == 'runai_streamer'"
        " && has(self.storage) && has(self.storage.s3))) || (has(self.storage) && has(self.storage.pvc))",
        "required when the artifact is written to storage.s3 (tensorizer, runai_streamer_sharded; runai_streamer "
        "with storage.s3): the checkpoint is fetched to the claim first, and a retried step resumes from it",
        lambda s: not (s.format.type in (FormatType.TENSORIZER.value, FormatType.RUNAI_STREAMER_SHARDED.value)
                       or (s.format.type == FormatType.RUNAI_STREAMER.value and _has_s3(s))) or _has_pvc(s),
        ".storage.pvc",
    ),
    Rule(
        "self.format.type != 'tensorizer' || self.format.pipelineParallelSize == 1",
        "tensorizer artifacts are cut per tensor-parallel rank only: pipelineParallelSize must be 1",
        lambda s: s.format.type != FormatType.TENSORIZER.value or s.format.pipeline_parallel_size == 1,
        ".format.pipelineParallelSize",
    ),
    Rule(
        "!(self.format.type in ['safetensors', 'sharded_state']) || (has(self.storage) && has(self.storage.pvc))",
        "required when format.type is safetensors or sharded_state (artifacts are written to a PVC)",
        lambda s: s.format.type not in (FormatType.SAFETENSORS.value, FormatType.SHARDED_STATE.value) or _has_pvc(s),
        ".storage.pvc",
    ),
    Rule(
        "self.format.type != 'runai_streamer' || self.source.uri.startsWith('s3://') || (has(self.storage) && has(self.storage.s3))",
        "runai_streamer streams from S3: use an s3:// source.uri or set storage.s3",
        lambda s: s.format.type != FormatType.RUNAI_STREAMER.value or s.source.uri.startswith("s3://") or _has_s3(s),
        ".format.type",
    ),
    Rule(
        "!(self.format.type in ['sharded_state', 'runai_streamer_sharded']) || self.format.pipelineParallelSize == 1"
        " || int(self.format.vllmVersion.split('.')[0]) > 0 || int(self.format.vllmVersion.split('.')[1]) >= 32",
        "sharded_state with pipelineParallelSize > 1 needs format.vllmVersion >= 0.32 (per-stage file names)",
        lambda s: s.format.type not in (FormatType.SHARDED_STATE.value, FormatType.RUNAI_STREAMER_SHARDED.value)
        or s.format.pipeline_parallel_size == 1
        or _version_at_least(s.format.vllm_version, (0, 32)),
        ".format.pipelineParallelSize",
    ),
]


def _version_at_least(version: str, floor: tuple[int, int]) -> bool:
    major, minor = (int(x) for x in version.split(".")[:2])
    return (major, minor) >= floor


class ModelWeightsSpec(Model):
    """Which weights, in which vLLM load format, for which serving Deployments."""

    model_config = ConfigDict(json_schema_extra=crd_validations(SPEC_RULES))

    source: Source = Field(description="Where the original checkpoint comes from.")
    storage: Storage | None = Field(None, description="Where prepared artifacts are kept.")
    format: Format = Field(
        default_factory=Format, description="Load format and parallelism.", json_schema_extra={"default": {}}
    )
    serving: Serving | None = Field(None, description="Serving Deployments to wire to the artifact.")
    deletion_policy: DeletionPolicy = Field(
        DeletionPolicy.RETAIN,
        description="Retain keeps prepared data when the ModelWeights is deleted; Delete removes it.",
    )

    @model_validator(mode="after")
    def _rules(self) -> "ModelWeightsSpec":
        return enforce(SPEC_RULES, self)


# --- status -------------------------------------------------------------------


class ConditionStatus(str, Enum):
    """Status of a condition."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class ConditionType(str, Enum):
    """Condition types Ferry sets. Ready is the kstatus summary."""

    READY = "Ready"
    RECONCILING = "Reconciling"
    STALLED = "Stalled"
    DOWNLOADED = "Downloaded"
    PREPARED = "Prepared"
    SERVING_UPDATED = "ServingUpdated"
    WEIGHTS_LOADED = "WeightsLoaded"


class Condition(Model):
    """metav1.Condition."""

    type: str = Field(
        max_length=316,
        pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$",
        description="Type of condition in CamelCase, e.g. Ready, Downloaded, Prepared.",
    )
    status: ConditionStatus = Field(description="True, False or Unknown.")
    observed_generation: int | None = Field(
        None, ge=0, description="metadata.generation the condition was set for.", json_schema_extra={"format": "int64"}
    )
    last_transition_time: datetime = Field(description="Last time the status changed.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
        description="Programmatic identifier of the last transition, in CamelCase.",
    )
    message: str = Field(max_length=32768, description="Human-readable details.")


class Phase(str, Enum):
    """One-word summary of the state."""

    PENDING = "Pending"
    FETCHING = "Fetching"
    PREPARING = "Preparing"
    WIRING = "Wiring"
    READY = "Ready"
    FAILED = "Failed"
    DELETING = "Deleting"


class Progress(Model):
    """Progress of the running step."""

    step: str | None = Field(None, max_length=64, description="Step in progress: fetch, shard, tensorize, verify.")
    bytes_done: int = Field(0, ge=0, description="Bytes processed.", json_schema_extra={"format": "int64"})
    bytes_total: int = Field(0, ge=0, description="Bytes to process (0 if unknown).", json_schema_extra={"format": "int64"})
    bytes_per_second: int = Field(0, ge=0, description="Recent throughput.", json_schema_extra={"format": "int64"})
    eta_seconds: int | None = Field(None, ge=0, description="Estimated seconds left.", json_schema_extra={"format": "int64"})
    percent: int = Field(0, ge=0, le=100, description="bytesDone / bytesTotal in percent.")
    updated_at: datetime | None = Field(None, description="When this progress was reported.")


# Routed experts per MoE layer (DeepSeek-V3: 256); a larger count is not a model's but a bad report.
MAX_EXPERTS = 1 << 16


class Artifact(Model):
    """The prepared artifact, once complete."""

    uri: str = Field(max_length=2048, description="Where the artifact is: pvc://claim/path or s3://bucket/prefix.")
    format: FormatType = Field(description="Load format of the artifact.")
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel size the artifact is cut for.")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline-parallel size the artifact is cut for.")
    vllm_version: str | None = Field(None, max_length=32, description="vLLM version the layout targets.")
    total_bytes: int = Field(0, ge=0, description="Size of all files.", json_schema_extra={"format": "int64"})
    size: str | None = Field(None, max_length=32, description="total_bytes for humans, e.g. 131Gi.")
    manifest_digest: str | None = Field(
        None, max_length=80, pattern=r"^sha256:[0-9a-f]{64}$", description="sha256 of ferry-manifest.json."
    )
    experts: int | None = Field(
        None, ge=0, le=MAX_EXPERTS,
        description="Routed experts per MoE layer, as the artifact was cut (unset: a dense model, or not pre-cut).",
    )
    expert_parallel: bool | None = Field(
        None, description="Whether the artifact's expert layers are cut for vLLM --enable-expert-parallel.")
    target: GpuTarget | None = Field(None, description="GPU family the artifact's MoE layout was cut for.")
    spec_digest: str | None = Field(
        None, max_length=64, pattern=r"^[0-9a-f]{8,64}$",
        description="Digest of the spec fields that shaped this artifact. While it matches the spec, this record "
                    "is the source of truth: prepare steps never run again, whether or not their Jobs and pods "
                    "still exist.",
    )


class LoadedReplicas(Model):
    """The serving pods of the current artifact whose loader verified and loaded the weights."""

    replicas: int = Field(0, ge=0, description="Desired replicas of the wired Deployments.")
    loaded_replicas: int = Field(0, ge=0, description="Pods of the current artifact with ferry.dev/weights-loaded True.")
    summary: str = Field("", max_length=32, description="loadedReplicas/replicas, e.g. 3/4.")
    p50_load_seconds: float | None = Field(None, ge=0, description="Median seconds the loaded pods' loader ran.")


class CompiledStateStatus(Model):
    """serving.compiledState as the serving pods' loaders found it."""

    key: str = Field("", max_length=80, description="The configuration key of the first wired workload's pods.")
    inputs: dict[str, Annotated[str, Field(max_length=512)]] = Field(
        default_factory=dict, max_length=8,
        description="What the key hashes (weights digest, image, command line hash): a change is named.")
    restored_replicas: int = Field(0, ge=0, description="Pods of the current artifact whose loader restored a "
                                                        "verified compiled state.")
    warmed: list[Annotated[str, Field(max_length=80, description="A configuration key.")]] = Field(
        default_factory=list, max_length=8,
        description="BeforeRollout: the keys whose warm-up Job finished (kept its state, or failed and the "
                    "rollout went on without it), newest last; a rollout to one of them is not held again.")
    message: str = Field("", max_length=1024, description="Why compiled state is or is not used, in words: "
                                                          "the latest pod's outcome, or why none applies.")


class NodeCacheEviction(Model):
    """A node that held the current artifact and no longer does."""

    node: str = Field(max_length=253, description="The node.")
    reason: str = Field(max_length=32, description="lru (made room for another fill), corrupt (a mount found a "
                                                   "file that does not match the manifest), removed (by an "
                                                   "admin), or unknown.")
    at: datetime | None = Field(None, description="When its node agent removed the entry.")
    pods: list[Annotated[str, Field(max_length=253, description="A pod's name.")]] = Field(
        default_factory=list, max_length=8,
        description="This object's serving pods on that node that still had a corrupt entry mounted: what "
                    "they loaded was verified, but a restarted container would read the damaged files.")


class NodeCacheStatus(Model):
    """Where the current artifact is held on node disk (serving.nodeCache)."""

    digest: str = Field("", max_length=80, description="The manifest digest the node cache entries are keyed by.")
    warm_nodes: int = Field(0, ge=0, description="Nodes that hold this digest: those whose node agent labels "
                                                 "the node with it, and, on nodes whose agent does not label "
                                                 "(yet), those whose fill completed.")
    filling_nodes: int = Field(0, ge=0, description="Nodes with a fill under way.")
    nodes: list[Annotated[str, Field(max_length=253, description="A node's name.")]] = Field(
                             default_factory=list, max_length=64,
                             description="The warm nodes, by name (the first 64).")
    summary: str = Field("", max_length=32, description="Warm nodes, and fills under way: e.g. 3 (+1).")
    evictions: list[NodeCacheEviction] = Field(
        default_factory=list, max_length=8,
        description="The latest nodes this artifact left (evicted, found corrupt, removed), newest last.")


class StepRetry(Model):
    """The retries of a failed prepare step (exponential backoff, bounded)."""

    step: str = Field(max_length=128, description="The step (name-digest) being retried.")
    attempt: int = Field(0, ge=0, description="Retries started so far; the first run is not counted.")
    last_error: str = Field("", max_length=2048, description="Why the last attempt failed.")
    next_attempt_at: datetime | None = Field(None, description="When the next retry starts; unset once it has.")


class ModelWeightsStatus(Model):
    """Observed state, following Kubernetes API conventions and kstatus."""

    observed_generation: int | None = Field(
        None, ge=0, description="Last metadata.generation the operator acted on.", json_schema_extra={"format": "int64"}
    )
    phase: Phase | None = Field(None, description="One-word summary derived from the conditions.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=32,
        description="Ready (summary), Reconciling, Stalled and step conditions.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    progress: Progress | None = Field(None, description="Progress of the running step.")
    artifact: Artifact | None = Field(None, description="The prepared artifact.")
    previous_artifacts: list[Artifact] = Field(
        default_factory=list, max_length=16,
        description="Artifacts of earlier specs still kept, newest first (deletionPolicy Retain keeps a bounded "
                    "number; Delete removes them once the current artifact is serving).",
    )
    retry: StepRetry | None = Field(None, description="Retries of the failed step, while there is one.")
    compiled_state: CompiledStateStatus | None = Field(
        None, description="serving.compiledState: the key, how many pods started warm, and why (not).")
    loaded: LoadedReplicas | None = Field(
        None, description="Serving pods that loaded the current artifact (serving.readinessGate).")
    cache: NodeCacheStatus | None = Field(
        None, description="Nodes holding the current artifact in their node cache (serving.nodeCache).")
    last_handled_requested_at: str | None = Field(
        None, max_length=64,
        description="The last value of the ferry.dev/requested-at annotation the operator acted on (set it to "
                    "anything new, e.g. $(date +%s), to retry a failed step at once).",
    )


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    namespace: str | None = None
    uid: str | None = None  # the object's identity: its artifacts' paths and prefixes carry it
    generation: int | None = None


class ModelWeights(Model):
    """ModelWeights: LLM weights, prepared for a vLLM load format and wired to serving Deployments."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["ferry.dev/v1alpha1"] = API_VERSION
    kind: Literal["ModelWeights"] = KIND
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: ModelWeightsSpec
    status: ModelWeightsStatus | None = None
