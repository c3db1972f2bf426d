"""Serving wiring: what Ferry writes into a vLLM Deployment. Pure.

Ferry owns a small set of vLLM flags in the chosen container's command line
(model, load format, parallel sizes, expert parallelism, loader config) and
leaves every other word as the user wrote it; `shapes` finds where
vLLM reads its model in the usual container shapes (`vllm serve MODEL`, the
api_server module, a `sh -c` script, an image entrypoint). The artifact is
mounted read-only at /ferry/weights (PVC, or a hostPath for the local
executor) or streamed from S3, and the pod template carries the artifact's
manifest digest, so a new artifact — and only a new artifact or new flags —
rolls the Deployment. `--served-model-name` keeps the model's name for
clients (see served_model_name).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from ..api.types import Artifact, FormatType, ModelWeightsSpec
from ..placement import Placement, placement_of
from .loader import (GATE, LOADER_CONTAINER, LOCAL_PATH, LOCAL_VOLUME, TOKEN_VOLUME, LoaderSettings,
                     fitted_resources, health_probe, loader_container, local_volume, token_volume, unwired_gates,
                     wired_gates)
from ..steps import pre_cut
from .compiled import HARVEST_CONTAINER, harvest_current, loader_args, plan_compiled
from .compiled import wire as wire_compiled
from .groups import GROUP_ANNOTATION, GROUP_INDEX_ENV, Group  # noqa: F401 (re-exported)
from .s3_env import S3_ENV_ANNOTATION, S3_ENV_NAMES, env_current, env_patch, owned_names, s3_env
from .shapes import (MANAGED_FLAGS, ParallelismUnsupported, Recognised,  # noqa: F401 (re-exported)
                     ServingError, last_flag, recognise)

MOUNT_PATH = "/ferry/weights"
VOLUME_NAME = "ferry-weights"
DIGEST_ANNOTATION = "ferry.dev/artifact-digest"
OWNER_ANNOTATION = "ferry.dev/modelweights"
# The --served-model-name Ferry wrote (absent when the user set their own): what
# tells Ferry's value, which it keeps current, from a user's, which it never touches.
SERVED_NAME_ANNOTATION = "ferry.dev/served-model-name"
# On a Deployment rolling in place (serving.rollout): its own strategy, put back afterwards (serving/rollout.py).
SAVED_STRATEGY = "ferry.dev/rollout-strategy"


@dataclass(frozen=True)
class WorkloadFacts:
    """What the handlers read from a serving workload: one pod template's wiring (an LeaderWorkerSet's
    worker template, its leader template in `leader`), and the workload's rollout (workloads.py reads the
    kinds other than Deployment)."""

    name: str
    containers: dict[str, list[str]]  # container name -> args, in pod-spec order
    template_annotations: dict[str, str]
    rolled_out: bool  # the controller has observed the latest generation and every replica is updated and available
    commands: dict[str, list[str]] = field(default_factory=dict)  # container name -> command (absent: none)
    init_containers: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> {image, args}
    readiness_gates: list[str] = field(default_factory=list)  # condition types
    probed: frozenset[str] = frozenset()  # containers with a readinessProbe
    service_account: str = "default"
    replicas: int = 1  # pods the workload runs when complete
    weights_volume: str = ""  # the source of the ferry-weights volume: persistentVolumeClaim, csi, hostPath, ""
    preferred_nodes: list[dict[str, Any]] = field(default_factory=list)  # nodeAffinity's preferred terms
    kind: str = "Deployment"
    group_size: int = 1  # pods per serving group as the workload runs them (an LWS's size; a StatefulSet's replicas)
    groups: int = 1  # serving groups (an LWS's replicas)
    leader: WorkloadFacts | None = None  # a LeaderWorkerSet's leaderTemplate, when it has one
    service_name: str = ""  # a StatefulSet's governing Service: its pods' DNS names
    resource_version: str = ""  # as read: an LWS's patch is refused if it changed since
    # Its own tolerations, nodeSelector and required node affinity: where its pods, and so its fill Jobs, may go.
    placement: Placement = field(default_factory=Placement)
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)  # container name -> its resources
    images: dict[str, str] = field(default_factory=dict)  # container name -> image
    envs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # (init) container name -> env
    # A Deployment's rollout: spec.strategy, the strategy Ferry saved (serving/rollout.py; the raw annotation),
    # its pods not of the current template (status.replicas - updatedReplicas), and its available pods.
    strategy: dict[str, Any] | None = None
    saved_strategy: str | None = None
    old_pods: int = 0
    available: int = 0
    host_ports: bool = False  # hostNetwork, or a container port bound on the node: pods of it cannot share one

    def served(self, container: str | None) -> tuple[str, list[str]]:
        """The vLLM container (the named one, else the first; "" if none) and its command line as read."""
        name = container or next(iter(self.containers), "")
        return name, self.commands.get(name, []) + self.containers.get(name, [])


def template_facts(name: str, template: Mapping[str, Any], **workload: Any) -> WorkloadFacts:
    """The wiring of one pod template (metadata + spec, as the API serves it)."""
    pod = template.get("spec") or {}
    containers = pod.get("containers") or []
    return WorkloadFacts(
        name=name,
        containers={c["name"]: list(c.get("args") or []) for c in containers},
        commands={c["name"]: list(c.get("command") or []) for c in containers},
        template_annotations=dict((template.get("metadata") or {}).get("annotations") or {}),
        init_containers={c["name"]: {"image": c.get("image"), "args": list(c.get("args") or [])}
                         for c in pod.get("initContainers") or []},
        readiness_gates=[g.get("conditionType", "") for g in pod.get("readinessGates") or []],
        probed=frozenset(c["name"] for c in containers if c.get("readinessProbe")),
        service_account=pod.get("serviceAccountName") or pod.get("serviceAccount") or "default",
        weights_volume=next((k for v in pod.get("volumes") or [] if v.get("name") == VOLUME_NAME
                             for k in v if k != "name"), ""),
        preferred_nodes=list(((pod.get("affinity") or {}).get("nodeAffinity") or {})
                             .get("preferredDuringSchedulingIgnoredDuringExecution") or []),
        placement=placement_of(pod),
        resources={c["name"]: dict(c.get("resources") or {}) for c in containers},
        images={c["name"]: str(c.get("image") or "") for c in containers},
        # Init containers too (names are unique across both lists): the loader's env is Ferry's to compare.
        envs={c["name"]: list(c.get("env") or []) for c in [*containers, *(pod.get("initContainers") or [])]},
        host_ports=bool(pod.get("hostNetwork")) or any(p.get("hostPort") for c in containers + list(
            pod.get("initContainers") or []) for p in c.get("ports") or []),
        **{"rolled_out": False, **workload},
    )


def deployment_facts(body: Mapping[str, Any]) -> WorkloadFacts:
    """What Ferry needs of a Deployment, from the object as the API serves it (JSON)."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    want = spec.get("replicas", 1) if spec.get("replicas") is not None else 1
    rolled_out = (
        (status.get("observedGeneration") or 0) >= (meta.get("generation") or 0)
        and (status.get("updatedReplicas") or 0) == want
        and (status.get("replicas") or 0) == want  # no old pods left
        and (status.get("availableReplicas") or 0) == want
    )
    saved = (meta.get("annotations") or {}).get(SAVED_STRATEGY)
    return template_facts(meta.get("name", ""), spec.get("template") or {}, rolled_out=rolled_out, replicas=want,
                          groups=want, strategy=spec.get("strategy"), saved_strategy=saved,
                          resource_version=meta.get("resourceVersion", ""),
                          old_pods=max(0, (status.get("replicas") or 0) - (status.get("updatedReplicas") or 0)),
                          available=status.get("availableReplicas") or 0)


def model_location(artifact_uri: str) -> str:
    """The --model value for an artifact: the mount for files, the URI for object stores."""
    if artifact_uri.startswith(("s3://", "gs://", "az://")):
        return artifact_uri.rstrip("/")
    return MOUNT_PATH


TENSORIZER_KEY_DIR = "/ferry/secrets/tensorizer"
TENSORIZER_KEY_VOLUME = "ferry-tensorizer-key"


def tensorizer_uri(spec: ModelWeightsSpec, artifact_uri: str) -> str:
    """The file (or per-rank %03d pattern) `ferry tensorize` wrote under the artifact's prefix."""
    options = spec.format.tensorizer
    layout = options.layout if options else "vllm"
    name = "model-rank-%03d.tensors" if layout == "vllm" and spec.format.tensor_parallel_size > 1 else "model.tensors"
    return f"{artifact_uri.rstrip('/')}/{name}"


def ferry_flags(spec: ModelWeightsSpec, artifact_uri: str = "") -> list[str]:
    """Ferry's flags besides the model (which goes where the shape says)."""
    fmt = spec.format
    flags = [
        "--load-format", fmt.type,
        "--tensor-parallel-size", str(fmt.tensor_parallel_size),
        "--pipeline-parallel-size", str(fmt.pipeline_parallel_size),
    ]
    if fmt.expert_parallel:
        flags.append("--enable-expert-parallel")
        if fmt.expert_placement != "linear":
            flags += ["--expert-placement-strategy", fmt.expert_placement]
    if fmt.type == FormatType.RUNAI_STREAMER.value and fmt.runai_streamer is not None:
        extra = fmt.runai_streamer.model_dump(exclude_none=True)
        if extra:
            flags += ["--model-loader-extra-config", json.dumps(extra, sort_keys=True)]
    if fmt.type == FormatType.TENSORIZER.value and artifact_uri.startswith("s3://"):
        # vLLM 0.32 copies these keys into its TensorizerConfig. No s3_* keys:
        # tensorizer then takes the endpoint from AWS_ENDPOINT_URL and the
        # credentials from boto3's chain (env from the Secret), so no secret
        # value is ever in the Deployment (docs/worker-tensorize.md).
        extra: dict = {"tensorizer_uri": tensorizer_uri(spec, artifact_uri)}
        if fmt.tensorizer and fmt.tensorizer.num_readers:
            extra["num_readers"] = fmt.tensorizer.num_readers
        if fmt.tensorizer and fmt.tensorizer.encryption_secret_ref:
            extra["encryption_keyfile"] = f"{TENSORIZER_KEY_DIR}/key"
        flags += ["--model-loader-extra-config", json.dumps(extra, sort_keys=True)]
    return flags


def served_model_name(spec: ModelWeightsSpec, user_model: str | None, ferry_set: str | None) -> str:
    """The name clients ask vLLM for, which Ferry keeps when it moves the model to the artifact.

    - hf://org/name: `org/name`, always (the source is the model).
    - otherwise, once Ferry has set it (`ferry_set`): that value. Ferry decides it
      when it first wires the container, while the user's model is still there to read.
    - otherwise the model the container named (positional or --model), verbatim:
      vLLM served it under that name, so that is what clients send.
    - otherwise (no model in the command line, e.g. only in a --config file, or
      Ferry's own mount left by an earlier wiring): the source's last path
      component (s3://bucket/models/llama-70b -> llama-70b).
    """
    uri = spec.source.uri
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://").strip("/")
    if ferry_set is not None:
        return ferry_set
    if user_model and user_model.rstrip("/") != MOUNT_PATH:
        return user_model
    return uri.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1] or uri


def volume_for(artifact_uri: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(volume, volumeMount) that put the artifact at MOUNT_PATH; None for object stores."""
    if artifact_uri.startswith("pvc://"):
        claim, _, sub_path = artifact_uri.removeprefix("pvc://").partition("/")
        mount = {"name": VOLUME_NAME, "mountPath": MOUNT_PATH, "readOnly": True}
        if sub_path:
            mount["subPath"] = sub_path
        # `$retainKeys`: a volume that was the node cache's keeps no `csi` next to the claim.
        return {"name": VOLUME_NAME, "$retainKeys": ["name", "persistentVolumeClaim"],
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}, mount
    if artifact_uri.startswith("file://"):
        volume = {"name": VOLUME_NAME, "hostPath": {"path": artifact_uri.removeprefix("file://"), "type": "Directory"}}
        return volume, {"name": VOLUME_NAME, "mountPath": MOUNT_PATH, "readOnly": True}
    return None


CACHE_DRIVER = "cache.ferry.dev"


def node_cache_on(spec: ModelWeightsSpec) -> bool:
    return bool(spec.serving and spec.serving.node_cache and spec.serving.node_cache.enabled)


def node_cache_volume(digest: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volume, volumeMount) of the node cache's entry of `digest`: a CSI ephemeral inline volume the node's
    agent mounts read-only once every byte is verified (no hostPath in the pod: Pod Security restricted
    allows it). `$retainKeys` drops the claim a previous wiring put under the same volume name, and the
    entry is the artifact's own directory, so no subPath."""
    volume = {"name": VOLUME_NAME, "$retainKeys": ["name", "csi"],
              "csi": {"driver": CACHE_DRIVER, "readOnly": True, "volumeAttributes": {"digest": digest}}}
    return volume, {"name": VOLUME_NAME, "mountPath": MOUNT_PATH, "readOnly": True, "subPath": None}


CACHE_LABEL_PREFIX = "cache.ferry.dev/"  # the node agent's labels (ferry_worker/cache/node_labels.py)
CACHE_LABEL_SALT = b"cache.ferry.dev node label of "  # the agent's LABEL_SALT (a test keeps them equal)
# Of 1-100, against the user's own preferred terms (a term of 100 outweighs it); the scheduler still puts
# fit (GPUs, memory) first: a preference only orders the nodes a pod fits on.
CACHE_AFFINITY_WEIGHT = 50


CACHE_AGENT_LABEL = CACHE_LABEL_PREFIX + "agent"  # on a node whose agent keeps its cache labels


def cache_label(digest: str) -> str:
    """The label the node agent puts on a node that holds the artifact's entry: a hash of the digest (node
    labels are readable cluster-wide; the digest is what a cache volume names), 63 hex digits."""
    return CACHE_LABEL_PREFIX + _label_hash(digest)[:63]


def cache_evicted_label(digest: str) -> str:
    """The label the agent leaves for a while when the entry goes: `<why>.<unix time>`."""
    return CACHE_LABEL_PREFIX + "evicted." + _label_hash(digest)[:55]


def _label_hash(digest: str) -> str:
    return hashlib.sha256(CACHE_LABEL_SALT + digest.removeprefix("sha256:").encode()).hexdigest()


def preferred_nodes(current: list[dict[str, Any]], digest: str | None) -> list[dict[str, Any]]:
    """The pod's preferred node affinity terms: the user's as they are, and Ferry's one term towards nodes
    whose cache holds `digest` (none when `digest` is None). The list has no merge key, so a patch
    replaces it whole: Ferry's terms are recognised by the label prefix and swapped, the user's kept."""
    def ferrys(term: dict[str, Any]) -> bool:
        return any(str(e.get("key", "")).startswith(CACHE_LABEL_PREFIX)
                   for e in (term.get("preference") or {}).get("matchExpressions") or [])

    terms = [t for t in current if not ferrys(t)]
    if digest is not None:
        terms.append({"weight": CACHE_AFFINITY_WEIGHT, "preference": {"matchExpressions": [
            {"key": cache_label(digest), "operator": "Exists"}]}})
    return terms


def loader_applies(spec: ModelWeightsSpec, artifact: Artifact, loader: LoaderSettings | None) -> bool:
    """Whether the pods get Ferry's loader and readiness gate: asked for, and an
    artifact with a manifest to verify (nothing is prepared for runai_streamer
    from the source bucket, so there is nothing to check it against)."""
    return bool(loader is not None and spec.serving is not None and spec.serving.readiness_gate
                and artifact.manifest_digest)


DATA_PARALLEL_FLAGS = frozenset({"--data-parallel-size", "-dp"})
EPLB_SWITCHES = frozenset({"--enable-eplb", "--no-enable-eplb"})


def parallelism_refusal(spec: ModelWeightsSpec, artifact: Artifact, shape: Recognised) -> str | None:
    """Why the container's own vLLM flags cannot serve a pre-cut MoE artifact; None if they can.

    Rank files carry only the tensor- and pipeline-parallel rank. With data
    parallelism vLLM spreads a MoE layer over tensor x data-parallel ranks (its
    MoE tensor-parallel or expert-parallel size grows with DP), and EPLB moves
    experts between ranks at run time: no file was cut for either.
    """
    if not (pre_cut(spec.format) and artifact.experts):
        return None
    what = (f"the artifact is a pre-cut {spec.format.type} artifact of a MoE model ({artifact.experts} experts "
            f"per layer), whose rank files carry only the tensor-parallel (and pipeline) rank")
    instead = "serve format.type safetensors, where vLLM cuts the experts itself"
    dp = last_flag(shape.args, DATA_PARALLEL_FLAGS)
    if dp is not None:
        word, value = dp.word, dp.value
        if value is not None and not value.literal:
            return (f"`{word} {value.raw or value.value}` sets vLLM's data-parallel size from a variable, which "
                    f"Ferry cannot read, and {what}: write the size literally (1), or {instead}")
        if value is not None and value.value.isdigit() and int(value.value) > 1:
            return (f"`{word} {value.value}` asks vLLM for data parallelism, but {what}: with data parallelism "
                    f"vLLM spreads the experts over tensor x data-parallel ranks "
                    f"({spec.format.tensor_parallel_size} x {value.value}), which no file was cut for; "
                    f"remove `{word}` (scale with Deployment replicas instead), or {instead}")
    eplb = last_flag(shape.args, EPLB_SWITCHES)
    if eplb is not None and eplb.name == "--enable-eplb":
        return (f"`{eplb.word}` turns on vLLM's expert-parallel load balancer, which moves experts between ranks "
                f"(and adds redundant ones) while serving, but {what} and a fixed set of experts each: "
                f"remove --enable-eplb, or {instead}")
    return None


def weights_source(spec: ModelWeightsSpec, artifact: Artifact) -> tuple[tuple[dict, dict] | None, str]:
    """(the volume and mount that put the artifact at MOUNT_PATH, None when it is read from a store; where
    vLLM and the loader read it). With serving.nodeCache the node's entry, for an S3 artifact too: then the
    pods read no S3 at all."""
    mounted = volume_for(artifact.uri)
    if node_cache_on(spec) and artifact.manifest_digest and (mounted is not None or artifact.uri.startswith("s3://")):
        mounted = node_cache_volume(artifact.manifest_digest)
    return mounted, MOUNT_PATH if mounted is not None else model_location(artifact.uri)


def _bring_weights(artifact: Artifact, pod: dict[str, Any], c: dict[str, Any], init: dict[str, Any] | None,
                   mounted: tuple[dict, dict] | None, had_volume: str, local: bool) -> None:
    """The serving container's (and the loader's) volumes and mounts for the artifact (their S3 env:
    _s3_env). Lists merge by name (volumes) or mountPath (volumeMounts), so what an earlier wiring added and
    this one does not want is deleted by name: the volume and both containers' mounts of it once the
    artifact is read from the store again."""
    if mounted is not None:
        volume, mount = mounted
        pod["volumes"] = [volume]
        c["volumeMounts"] = [mount]
        if local:
            pod["volumes"].append(local_volume(artifact.total_bytes))
            c["volumeMounts"].append({"name": LOCAL_VOLUME, "mountPath": LOCAL_PATH, "readOnly": True})
        return
    if had_volume:
        unmount = {"mountPath": MOUNT_PATH, "$patch": "delete"}
        pod["volumes"] = [{"name": VOLUME_NAME, "$patch": "delete"}]
        c["volumeMounts"] = [unmount]
        if init is not None:
            init["volumeMounts"].append(unmount)


@dataclass(frozen=True)
class S3Env:
    """The S3 env (endpoint, region, credentials by named key) each container that reads S3 gets: the
    serving container (`vllm`) where it streams the artifact; the loader where it reads the artifact or the
    compiled state's store; the harvest where it publishes there. `owned`: the names Ferry wrote into the
    serving container before (its annotation), which it may delete; all of S3_ENV_NAMES are Ferry's in its
    own two containers."""

    vllm: list[dict[str, Any]]
    loader: list[dict[str, Any]]
    harvest: list[dict[str, Any]]
    owned: frozenset[str]

    def current(self, current: WorkloadFacts, name: str, loaded: bool, harvested: bool) -> bool:
        return (env_current(current.envs.get(name, []), self.vllm, self.owned)
                and (not loaded or env_current(current.envs.get(LOADER_CONTAINER, []), self.loader, S3_ENV_NAMES))
                and (not harvested or env_current(current.envs.get(HARVEST_CONTAINER, []), self.harvest,
                                                  S3_ENV_NAMES)))


def s3_env_of(spec: ModelWeightsSpec, artifact: Artifact, mounted: Any, compiled: Any,
              current: WorkloadFacts, name: str) -> S3Env:
    env = s3_env(spec) if mounted is None else []  # vLLM streams the artifact from S3
    store = list(compiled.store_env) if compiled.on and compiled.s3_store else []
    return S3Env(vllm=env, loader=env or store, harvest=store,
                 owned=owned_names(current.template_annotations.get(S3_ENV_ANNOTATION), _legacy(spec, artifact,
                                                                                                current, name)))


def _legacy(spec: ModelWeightsSpec, artifact: Artifact, current: WorkloadFacts, name: str) -> frozenset[str]:
    """The S3 env names Ferry wrote into the serving container of a template it wired before it recorded
    them (its digest annotation, no ferry.dev/s3-env): those the loader holds too (it gave both the same
    env), else, with no loader, the spec's for an S3 artifact; none in a template Ferry never wired."""
    if DIGEST_ANNOTATION not in current.template_annotations:
        return frozenset()
    held = {e.get("name") for e in current.envs.get(name, []) if isinstance(e, dict)} & S3_ENV_NAMES
    if LOADER_CONTAINER in current.envs:
        return frozenset(held & {e.get("name") for e in current.envs[LOADER_CONTAINER] if isinstance(e, dict)})
    return frozenset(held & {e["name"] for e in s3_env(spec)}) if artifact.uri.startswith("s3://") else frozenset()


def _s3_env(s3: S3Env, current: WorkloadFacts, name: str, pod: dict[str, Any], c: dict[str, Any],
            init: dict[str, Any] | None, annotations: dict[str, Any]) -> None:
    """Each container's S3 env in the patch: Ferry's entries, and a delete for each it wrote and no longer
    wants (in the loader and the harvest: any of S3_ENV_NAMES; in vLLM's: those its annotation lists)."""
    vllm = env_patch(current.envs.get(name, []), s3.vllm, s3.owned)
    if vllm:
        c["env"] = [*vllm, *c.get("env", [])]
    if init is not None:
        init["env"] += env_patch(current.envs.get(LOADER_CONTAINER, []), s3.loader, S3_ENV_NAMES)
    for harvest in pod.get("initContainers") or []:
        if harvest.get("name") == HARVEST_CONTAINER and "$patch" not in harvest:
            env = env_patch(current.envs.get(HARVEST_CONTAINER, []), s3.harvest, S3_ENV_NAMES)
            if env:
                harvest["env"] = [*env, *harvest.get("env", [])]
    # Recorded in every patch ("" for none): what Ferry owns in vLLM's env from now on.
    annotations[S3_ENV_ANNOTATION] = ",".join(sorted(e["name"] for e in s3.vllm))


@dataclass(frozen=True)
class _Wiring:
    """What template_patch decided for the serving container `name`: its command line as it is and as Ferry
    wants it, the loader init container (None: ungated), the compiled state, the S3 env, and what the
    template carried of an earlier wiring."""

    name: str
    command: list[str]
    args: list[str]
    new_command: list[str]
    new_args: list[str]
    ferry_set: str | None  # the --served-model-name Ferry wrote before
    served: str | None  # the one it writes now (None: the user's own)
    mounted: tuple[dict, dict] | None
    local: bool
    digest: str
    init: dict[str, Any] | None
    compiled: Any
    s3: S3Env
    group: Group | None
    was_grouped: bool
    unprobed: bool  # in a group whose pods do not all serve HTTP: no readiness probe
    probe_current: bool
    preferred: list[dict[str, Any]]

    @property
    def argv(self) -> list[str]:
        return self.new_command + self.new_args


def _serving_container(spec: ModelWeightsSpec, artifact: Artifact, container: str | None,
                       current: WorkloadFacts) -> tuple[str, list[str], list[str], Recognised]:
    """The container Ferry wires (the named one, else the first), its command and args, and its shape."""
    if not current.containers:
        raise ServingError(f"deployment {current.name} has no containers")
    name = container or next(iter(current.containers))
    if name not in current.containers:
        raise ServingError(
            f"deployment {current.name} has no container {name!r} (has: {', '.join(current.containers)})"
        )
    command, args = list(current.commands.get(name) or []), list(current.containers[name])
    try:
        shape = recognise(command, args)
    except ServingError as exc:
        raise ServingError(f"deployment {current.name} container {name!r}: {exc}") from None
    refusal = parallelism_refusal(spec, artifact, shape)
    if refusal is not None:
        raise ParallelismUnsupported(f"deployment {current.name} container {name!r}: {refusal}")
    return name, command, args, shape


def _loader_init(loader: LoaderSettings, location: str, digest: str, mounted: tuple[dict, dict] | None,
                 local: bool, serving_resources: dict[str, Any]) -> dict[str, Any]:
    """Ferry's loader init container: requests fitted under the serving container's, and the copy to the
    pod's local disk when serving.localCopy asks for one."""
    init = loader_container(loader, location, digest, [mounted[1]] if mounted else [])
    fitted = fitted_resources(loader.resources, serving_resources)
    init.pop("resources", None)
    if fitted:
        init["resources"] = fitted
    if local:
        init["args"] += ["--copy-to", LOCAL_PATH]
        init["volumeMounts"].append({"name": LOCAL_VOLUME, "mountPath": LOCAL_PATH})
    return init


def _wiring(spec: ModelWeightsSpec, artifact: Artifact, container: str | None, current: WorkloadFacts,
            loader: LoaderSettings | None, group: Group | None) -> _Wiring:
    name, command, args, shape = _serving_container(spec, artifact, container, current)
    ferry_set = current.template_annotations.get(SERVED_NAME_ANNOTATION)
    ours = ferry_set is not None and shape.served_names == [ferry_set]
    served = None
    if shape.served_names is None or ours:
        served = served_model_name(spec, shape.model, ferry_set if ours else None)
    gated = loader_applies(spec, artifact, loader)
    mounted, location = weights_source(spec, artifact)
    local = gated and mounted is not None and spec.serving.local_copy
    flags = ferry_flags(spec, artifact.uri) + (group.vllm_flags() if group else [])
    was_grouped = GROUP_ANNOTATION in current.template_annotations
    new_command, new_args = shape.wire(LOCAL_PATH if local else location, flags, served, ours,
                                       group is not None or was_grouped)
    digest = artifact.manifest_digest or artifact.uri
    init = (_loader_init(loader, location, digest, mounted, local, current.resources.get(name) or {})
            if gated else None)
    argv = new_command + new_args
    compiled = plan_compiled(spec, artifact, current.images.get(name, ""), argv, init is not None,
                             current.envs.get(name, []), group)
    if init is not None and compiled.on:
        init["args"] += loader_args(compiled)
    group_env = _group_env(group, was_grouped)
    if init is not None and group is not None:
        init["args"] += group.loader_args()
    if init is not None and group_env is not None:
        init["env"].append(group_env)
    # In a group, only a template whose every pod serves HTTP is probed; a probe on one that does not
    # (Ferry's from before, or a copy of the leader's) would keep its pods unready for good.
    unprobed = group is not None and not group.probe
    cached = artifact.manifest_digest if mounted is not None and "csi" in mounted[0] else None
    return _Wiring(
        name=name, command=command, args=args, new_command=new_command, new_args=new_args, ferry_set=ferry_set,
        served=served, mounted=mounted, local=local, digest=digest, init=init, compiled=compiled,
        s3=s3_env_of(spec, artifact, mounted, compiled, current, name), group=group, was_grouped=was_grouped,
        unprobed=unprobed, probe_current=(name not in current.probed) if unprobed else name in current.probed,
        preferred=preferred_nodes(current.preferred_nodes, cached))


def _group_env(group: Group | None, was_grouped: bool) -> dict[str, Any] | None:
    """The group index env entry of the serving container and the loader: the group's, or its deletion from
    a template that was grouped before."""
    if group is not None:
        return group.env()
    return {"name": GROUP_INDEX_ENV, "$patch": "delete"} if was_grouped else None


def _at_rest(w: _Wiring, current: WorkloadFacts) -> bool:
    """Whether the template already carries this wiring: nothing to patch, nothing to roll."""
    have = current.init_containers.get(LOADER_CONTAINER)
    init = w.init
    loader_current = (have == {"image": init["image"], "args": init["args"]} and GATE in current.readiness_gates
                      and w.probe_current) if init else (have is None and GATE not in current.readiness_gates)
    # A changed S3 secret, endpoint or region is in the env Ferry gives the containers: that rolls too.
    loader_current = (loader_current
                      and harvest_current(w.compiled, current.init_containers.get(HARVEST_CONTAINER),
                                          init["image"] if init else "")
                      and w.s3.current(current, w.name, init is not None, w.compiled.on))
    # Turning the node cache on or off swaps the volume's source under the same digest: that rolls too.
    volume_current = (not current.weights_volume if w.mounted is None
                      else (current.weights_volume == "csi") == ("csi" in w.mounted[0]))
    return (w.new_command == w.command and w.new_args == w.args and w.ferry_set == w.served and loader_current
            and volume_current and w.preferred == current.preferred_nodes
            and current.template_annotations.get(DIGEST_ANNOTATION) == w.digest)


def _wire_loader(w: _Wiring, current: WorkloadFacts, pod: dict[str, Any], c: dict[str, Any]) -> None:
    """The loader init container, its readiness gate and token volume, and vLLM's readiness probe; or their
    deletion where the template had them and this wiring is ungated."""
    if w.init is not None:
        pod["initContainers"] = [w.init]
        pod["readinessGates"] = wired_gates(current.readiness_gates)
        pod.setdefault("volumes", []).append(token_volume())
        if not w.probe_current and not w.unprobed:
            c["readinessProbe"] = health_probe(w.argv)
    elif LOADER_CONTAINER in current.init_containers or GATE in current.readiness_gates:
        pod["initContainers"] = [{"name": LOADER_CONTAINER, "$patch": "delete"}]
        pod["readinessGates"] = unwired_gates(current.readiness_gates)
        pod.setdefault("volumes", []).append({"name": TOKEN_VOLUME, "$patch": "delete"})


def _wire_tensorizer_key(spec: ModelWeightsSpec, pod: dict[str, Any], c: dict[str, Any]) -> None:
    """The tensorizer encryption key, by its named key, read-only to vLLM."""
    key = spec.format.tensorizer.encryption_secret_ref if spec.format.tensorizer else None
    if key is None or spec.format.type != FormatType.TENSORIZER.value:
        return
    pod.setdefault("volumes", []).append({"name": TENSORIZER_KEY_VOLUME, "secret": {
        "secretName": key.name, "defaultMode": 0o400, "items": [{"key": "key", "path": "key"}]}})
    c.setdefault("volumeMounts", []).append({"name": TENSORIZER_KEY_VOLUME, "mountPath": TENSORIZER_KEY_DIR,
                                             "readOnly": True})


def _annotations(w: _Wiring, mw_name: str) -> dict[str, Any]:
    annotations: dict[str, Any] = {DIGEST_ANNOTATION: w.digest, OWNER_ANNOTATION: mw_name}
    if w.group is not None:
        annotations[GROUP_ANNOTATION] = str(w.group.size)
    elif w.was_grouped:
        annotations[GROUP_ANNOTATION] = None
    if w.served is not None:
        annotations[SERVED_NAME_ANNOTATION] = w.served
    elif w.ferry_set is not None:
        annotations[SERVED_NAME_ANNOTATION] = None  # the user set their own: Ferry's is gone
    return annotations


def template_patch(
    spec: ModelWeightsSpec, mw_name: str, artifact: Artifact, container: str | None, current: WorkloadFacts,
    loader: LoaderSettings | None = None, group: Group | None = None,
) -> dict[str, Any] | None:
    """The strategic-merge patch of the pod template (`{"spec": {"template": ...}}`) that wires `current`
    to the artifact; None if already wired. `group`: its pods form serving groups (Group).

    Idempotent: a container this patch wired yields the same command, args and
    annotations, so the workload rolls once per change, never per reconcile.
    """
    w = _wiring(spec, artifact, container, current, loader, group)
    if _at_rest(w, current):
        return None
    # A container that fails leaves the tail of its log (vLLM's own error line)
    # as its termination message, which the operator quotes (serving/diagnosis.py).
    # Not part of what makes a template current: set whenever Ferry rewires.
    c: dict[str, Any] = {"name": w.name, "args": w.new_args, "terminationMessagePolicy": "FallbackToLogsOnError"}
    if w.new_command != w.command:
        c["command"] = w.new_command
    pod: dict[str, Any] = {"containers": [c]}
    if w.preferred != current.preferred_nodes:
        pod["affinity"] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": w.preferred}}
    _bring_weights(artifact, pod, c, w.init, w.mounted, current.weights_volume, w.local)
    group_env = _group_env(w.group, w.was_grouped)
    if group_env is not None:
        c.setdefault("env", []).append(group_env)
    if w.unprobed and w.name in current.probed:
        c["readinessProbe"] = None
    _wire_tensorizer_key(spec, pod, c)
    _wire_loader(w, current, pod, c)
    wire_compiled(w.compiled, pod, c, w.init, current.init_containers.get(HARVEST_CONTAINER), VOLUME_NAME)
    annotations = _annotations(w, mw_name)
    _s3_env(w.s3, current, w.name, pod, c, w.init, annotations)
    return {"spec": {"template": {"metadata": {"annotations": annotations}, "spec": pod}}}
