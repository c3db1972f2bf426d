"""serving.compiledState: the pod template pieces that keep vLLM's compiled state and hand it on. Pure.

With `mode: AfterFirstReady`, a wired pod whose weights come from a claim gets:

- `VLLM_CACHE_ROOT=/ferry/compiled` on the vLLM container, an emptyDir: where vLLM writes (and looks for)
  its Dynamo/Inductor/Triton caches;
- the loader (`ferry load --compiled-store ... --compiled-key KEY --compiled-to /ferry/compiled`) restores
  `<claim>/<subPath>/<uid>/compiled/KEY/<device kind>` there after the weights, verified in full, else
  nothing (it mounts that directory read-only);
- a native sidecar `ferry-compiled-harvest` (the worker image) that waits for vLLM's /health and then
  publishes the cache root under the same name, once per key and device kind (it alone mounts the store
  read-write; the vLLM container never does).

KEY hashes what the pod's compile depends on that Ferry can see: the weights' manifest digest, the vLLM
container's image, its wired command line (TP, PP and every flag in it). The device kind (GPU models,
else the CPU's ISA flags) is the pod's own, read on its node. vLLM's own cache key (its env, config, code
and compiler) still decides whether it uses what it finds: a stale entry is inert, never wrong.

The store lives under the ModelWeights' uid on its own claim: only this object's pods mount it, and a
state is never shared across objects, namespaces or images (docs/security.md). For an artifact Ferry
published to storage.s3, the store is in S3 beside it (`<storage.s3.uri>/<ns>/<name>/<uid>/compiled`): the
loader and the harvest reach it with the object's S3 credentials (by named keys: those vLLM streams the
artifact with; under the node cache only these two containers hold them), and the harvest packs its tar in
a scratch emptyDir (the root filesystem is read-only).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from ..api.types import Artifact, CompiledStateMode, ModelWeightsSpec
from ..locations import OBJECT_STORE_FORMATS
from .groups import GROUP_INDEX_ENV, Group
from .loader import health_endpoint, served_host
from .s3_env import S3_ENV_NAMES, s3_env

ENV = "VLLM_CACHE_ROOT"
CACHE_VOLUME, CACHE_PATH = "ferry-compiled", "/ferry/compiled"
STORE_VOLUME, STORE_PATH = "ferry-compiled-store", "/ferry/compiled-store"
STORE_DIR = "compiled"  # beside the object's artifacts: <subPath>/<uid>/compiled
HARVEST_CONTAINER = "ferry-compiled-harvest"
# With the store in S3: where the harvest packs its tar (TMPDIR), capped as the state is (16 GiB and headers).
SCRATCH_VOLUME, SCRATCH_PATH, SCRATCH_LIMIT = "ferry-compiled-scratch", "/ferry/compiled-scratch", "17Gi"
# The vLLM container's env entries Ferry writes itself: not the user's configuration, so not in the key.
FERRY_ENV = frozenset({ENV, GROUP_INDEX_ENV})
# vLLM compiles nothing with these (vLLM 0.32: --enforce-eager; -O0 is compilation mode NONE).
EAGER_FLAGS = ("--enforce-eager", "--enforce_eager", "-O0")


@dataclass(frozen=True)
class Compiled:
    """The compiled-state wiring of one pod template: `key` when it applies, else `reason` says why not."""

    key: str = ""
    reason: str = ""
    claim: str = ""
    sub_path: str = ""
    health_url: str = "http://127.0.0.1:8000/health"  # where the harvest learns that vLLM serves
    group: Group | None = None  # a pod of a multi-node group keeps its own entry (--group-index)
    s3_store: str = ""  # the store in S3 (s3://.../compiled), beside an artifact Ferry published there
    store_env: tuple[dict[str, Any], ...] = ()  # what the harvest needs to reach the S3 store
    inputs: tuple[tuple[str, str], ...] = ()  # what the key hashes, by name, for the status to name a change

    @property
    def on(self) -> bool:
        return bool(self.key)


@dataclass(frozen=True)
class WarmUpFacts:
    """BeforeRollout: one warm-up Job as its status says (executors/warm_up.py): Running (`message`: why its
    pod is not scheduled, if so), Succeeded, or Failed (`message`: its harvest's or the Job's last words)."""

    key: str
    job: str
    phase: str
    message: str = ""


def store_of(artifact_uri: str) -> tuple[str, str] | None:
    """(claim, the object's own directory on it) for a claim artifact `pvc://CLAIM/<subPath>/<uid>/<digest>/
    artifact`; None otherwise."""
    if not artifact_uri.startswith("pvc://"):
        return None
    claim, _, path = artifact_uri.removeprefix("pvc://").partition("/")
    parts = path.split("/")
    if len(parts) < 3 or parts[-1] != "artifact" or not all(parts):
        return None
    return claim, "/".join(parts[:-2])


def s3_store_of(spec: ModelWeightsSpec, artifact_uri: str) -> str | None:
    """The S3 store beside an artifact Ferry published to storage.s3 (`<storage.s3.uri>/<ns>/<name>/<uid>/
    <digest>`, locations.s3_artifact_uri): `.../<uid>/compiled`; None for any other URI."""
    s3 = spec.storage.s3 if spec.storage else None
    if s3 is None or spec.format.type not in OBJECT_STORE_FORMATS:
        return None
    base = s3.uri.rstrip("/") + "/"
    parts = artifact_uri[len(base):].split("/") if artifact_uri.startswith(base) else []
    if len(parts) != 4 or not all(parts) or any(p in (".", "..") for p in parts):
        return None
    return base + "/".join(parts[:3] + [STORE_DIR])


# --host values under which vLLM answers on 127.0.0.1, where the harvest asks (0.0.0.0 and :: are every address)
LOOPBACK_SERVED = frozenset({"0.0.0.0", "::", "127.0.0.1", "localhost", ""})


def plan_compiled(spec: ModelWeightsSpec, artifact: Artifact, image: str, words: list[str], gated: bool,
                  env: list[dict[str, Any]] = (), group: Group | None = None) -> Compiled:
    """Whether the template keeps and restores compiled state, and under which key. `env`: the vLLM
    container's env as the user wrote it (vLLM's own cache key hashes some of it; Ferry's entries excluded).
    `group`: the template's pods form multi-node groups; each pod keeps its own entry (its ranks')."""
    setting = spec.serving.compiled_state if spec.serving else None
    if setting is None or setting.mode == CompiledStateMode.OFF.value:
        return Compiled(reason="serving.compiledState.mode is Off: vLLM compiles in every pod")
    eager = next((w for w in words for f in EAGER_FLAGS if w == f or w.startswith(f + "=")), None)
    if eager is not None:
        return Compiled(reason=f"the vLLM command line has {eager}: vLLM compiles nothing, so nothing is kept or "
                               f"restored")
    if not gated:
        return Compiled(reason="serving.compiledState needs serving.readinessGate: the loader restores it")
    host = served_host(words)
    if host is not None and host not in LOOPBACK_SERVED and (group is None or group.probe):
        return Compiled(reason=f"the vLLM command line has --host {host}: the harvest waits for vLLM's /health "
                               f"on 127.0.0.1 in the pod; drop --host (vLLM serves every address) to keep "
                               f"compiled state")
    store, s3_store = store_of(artifact.uri), s3_store_of(spec, artifact.uri)
    pvc = spec.storage.pvc if spec.storage else None
    if store is not None and pvc is not None and pvc.access_modes and set(pvc.access_modes) == {"ReadOnlyMany"}:
        return Compiled(reason="serving.compiledState needs a claim the harvest can write: storage.pvc.accessModes "
                               "is ReadOnlyMany")
    if store is None and s3_store is None:
        return Compiled(reason=f"serving.compiledState needs an artifact on a claim (storage.pvc) or one Ferry "
                               f"published to storage.s3; {artifact.uri.split('://')[0]}:// artifacts of this "
                               f"kind have none")
    # Ferry's S3 env arrives with its wiring: not the user's configuration (it would re-key the next reconcile).
    own = [e for e in env if isinstance(e, dict) and e.get("name") not in FERRY_ENV | S3_ENV_NAMES]
    seen = json.dumps([artifact.manifest_digest or artifact.uri, image, words, own], separators=(",", ":"),
                      sort_keys=True)
    key = hashlib.sha256(seen.encode()).hexdigest()[:32]
    command = hashlib.sha256(json.dumps(words).encode()).hexdigest()[:12]
    environment = hashlib.sha256(json.dumps(own, sort_keys=True).encode()).hexdigest()[:12]
    inputs = (("weights", artifact.manifest_digest or artifact.uri), ("image", image), ("command line", command),
              ("env", environment))
    port, scheme = health_endpoint(words)  # the readiness probe's
    health = group.health_address(port, scheme) if group else f"{scheme}://127.0.0.1:{port}/health"
    if s3_store is not None:
        return Compiled(key=key, health_url=health, group=group, inputs=inputs, s3_store=s3_store,
                        store_env=tuple(s3_env(spec)))
    return Compiled(key=key, claim=store[0], sub_path=store[1], health_url=health, group=group, inputs=inputs)


def changed(before: dict[str, str], after: Compiled) -> str:
    """Which key inputs differ from the ones recorded before, in words ("" if none or none recorded)."""
    names = [name for name, value in after.inputs if name in before and before[name] != value]
    return ", ".join(names)


def _store(compiled: Compiled) -> str:
    return compiled.s3_store or f"{STORE_PATH}/{STORE_DIR}"


def loader_args(compiled: Compiled) -> list[str]:
    return ["--compiled-store", _store(compiled), "--compiled-key", compiled.key, "--compiled-to", CACHE_PATH]


def harvest_container(compiled: Compiled, image: str, pull_policy: str | None, security: dict[str, Any],
                      store: str = STORE_VOLUME) -> dict[str, Any]:
    if compiled.s3_store:  # packs its tar in the scratch emptyDir, uploads it with the pod's S3 credentials
        mount = {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_PATH}
        env = [{"name": "TMPDIR", "value": SCRATCH_PATH}]  # its S3 credentials: wiring's S3Env
    else:
        mount, env = {"name": store, "mountPath": STORE_PATH, "subPath": compiled.sub_path}, []
    container: dict[str, Any] = {
        "name": HARVEST_CONTAINER, "image": image, "restartPolicy": "Always",  # a native sidecar
        "command": ["ferry"],
        "args": ["compiled-harvest", "--cache-root", CACHE_PATH, "--store", _store(compiled),
                 "--key", compiled.key, "--health-url", compiled.health_url]
        + (["--group-index", f"$({GROUP_INDEX_ENV})"] if compiled.group else []),
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_PATH, "readOnly": True}, mount],
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": security,
    }
    if compiled.group:  # the kubelet expands $(FERRY_GROUP_INDEX) in the args from this
        env.append(compiled.group.env())
    if env:
        container["env"] = env
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    return container


def _store_volume(compiled: Compiled, pod: dict[str, Any], weights_volume: str) -> str:
    """The volume the store is mounted from. A pod may not list one claim twice (the kubelet waits for the
    second volume for ever), so where the weights are that claim already, its volume serves both: it is
    then writable, and every mount of the weights stays read-only (mount-level readOnly)."""
    for v in pod.get("volumes") or []:
        claim = v.get("persistentVolumeClaim") or {}
        if v.get("name") == weights_volume and claim.get("claimName") == compiled.claim:
            claim["readOnly"] = False
            # One the node cache's wiring added before goes: the same claim twice never starts.
            pod["volumes"].append({"name": STORE_VOLUME, "$patch": "delete"})
            return weights_volume
    pod.setdefault("volumes", []).append({"name": STORE_VOLUME,
                                          "persistentVolumeClaim": {"claimName": compiled.claim}})
    return STORE_VOLUME


def was_s3_store(have: dict[str, Any] | None) -> bool:
    """Whether the template's harvest (as read: its args) keeps the state in S3."""
    return _flag(list((have or {}).get("args") or []), "--store").startswith("s3://")


def wire(compiled: Compiled, pod: dict[str, Any], c: dict[str, Any], init: dict[str, Any] | None,
         have: dict[str, Any] | None, weights_volume: str) -> None:
    """Add the pieces (compiled.on) or delete those an earlier wiring added (`have`: the template's harvest
    as read, None if it has none) in the template patch. Lists merge by name or mountPath, so what the other
    store's wiring added is deleted by name; a delete directive goes only into a container the template has."""
    if compiled.on and init is not None:  # its args carry loader_args(compiled) already (they decide current)
        if compiled.s3_store:
            _wire_s3_store(compiled, pod, init, have)
        else:
            _wire_claim_store(compiled, pod, init, have, weights_volume)
        pod.setdefault("volumes", []).append({"name": CACHE_VOLUME, "emptyDir": {}})
        c.setdefault("env", []).append({"name": ENV, "value": CACHE_PATH})
        c.setdefault("volumeMounts", []).append({"name": CACHE_VOLUME, "mountPath": CACHE_PATH})
    elif have is not None:
        if init is not None:  # mounts merge by mountPath: the loader's of the volumes that go, go too
            init["volumeMounts"] += [{"mountPath": CACHE_PATH, "$patch": "delete"},
                                     {"mountPath": STORE_PATH, "$patch": "delete"}]
        pod.setdefault("initContainers", []).append({"name": HARVEST_CONTAINER, "$patch": "delete"})
        pod.setdefault("volumes", []).extend([{"name": name, "$patch": "delete"}
                                              for name in (CACHE_VOLUME, STORE_VOLUME, SCRATCH_VOLUME)])
        c.setdefault("env", []).append({"name": ENV, "$patch": "delete"})
        c.setdefault("volumeMounts", []).append({"mountPath": CACHE_PATH, "$patch": "delete"})


def _wire_s3_store(compiled: Compiled, pod: dict[str, Any], init: dict[str, Any], have: dict[str, Any] | None) -> None:
    harvest = harvest_container(compiled, init["image"], init.get("imagePullPolicy"), init["securityContext"])
    init["volumeMounts"].append({"name": CACHE_VOLUME, "mountPath": CACHE_PATH})
    pod.setdefault("volumes", []).append({"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": SCRATCH_LIMIT}})
    if have is not None and not was_s3_store(have):  # from the claim's store: its volume and mounts go
        init["volumeMounts"].append({"mountPath": STORE_PATH, "$patch": "delete"})
        harvest["volumeMounts"].append({"mountPath": STORE_PATH, "$patch": "delete"})
        pod["volumes"].append({"name": STORE_VOLUME, "$patch": "delete"})
    pod["initContainers"] = [init, _ungrouped(compiled, harvest, have)]


def _wire_claim_store(compiled: Compiled, pod: dict[str, Any], init: dict[str, Any], have: dict[str, Any] | None,
                      weights_volume: str) -> None:
    store = _store_volume(compiled, pod, weights_volume)
    harvest = harvest_container(compiled, init["image"], init.get("imagePullPolicy"), init["securityContext"], store)
    init["volumeMounts"] += [{"name": CACHE_VOLUME, "mountPath": CACHE_PATH},
                             {"name": store, "mountPath": STORE_PATH, "subPath": compiled.sub_path, "readOnly": True}]
    if was_s3_store(have):  # from S3: the scratch volume and its mount go (the S3 env: wiring's S3Env)
        harvest["volumeMounts"].append({"mountPath": SCRATCH_PATH, "$patch": "delete"})
        harvest["env"] = [*harvest.get("env", []), {"name": "TMPDIR", "$patch": "delete"}]
        pod.setdefault("volumes", []).append({"name": SCRATCH_VOLUME, "$patch": "delete"})
    pod["initContainers"] = [init, _ungrouped(compiled, harvest, have)]


def _ungrouped(compiled: Compiled, harvest: dict[str, Any], have: dict[str, Any] | None) -> dict[str, Any]:
    """A harvest wired for a group before (--group-index) and no longer: its group index env goes too."""
    if compiled.group is None and have is not None and "--group-index" in (have.get("args") or []):
        harvest["env"] = [*harvest.get("env", []), {"name": GROUP_INDEX_ENV, "$patch": "delete"}]
    return harvest


def harvest_current(compiled: Compiled, have: dict[str, Any] | None, image: str) -> bool:
    """Whether the template's sidecar is what `compiled` wants (absent when off)."""
    if not compiled.on:
        return have is None
    return have is not None and have.get("image") == image and have.get("args") == harvest_container(
        compiled, image, None, {})["args"]


# What the loader appends to its pod condition's message (compiled/state.py Outcome.describe).
_OUTCOME = re.compile(r"compiled state (restored|absent|refused|published|present): ([^;]{0,600})")


def pod_outcome(message: str) -> tuple[str, str] | None:
    """(state, reason) a loader reported for compiled state (untrusted words: shown, never acted on)."""
    found = _OUTCOME.search(message or "")
    return (found.group(1), found.group(2)) if found else None



def compiled_key(loader_args: list[str]) -> str:
    """The --compiled-key a wired template's loader carries ("" if none)."""
    return _flag(loader_args, "--compiled-key")


def _flag(args: list[str], flag: str) -> str:
    """The value after `flag` in args Ferry wrote ("" if it is not there)."""
    for i, word in enumerate(args[:-1]):
        if word == flag:
            return args[i + 1]
    return ""
