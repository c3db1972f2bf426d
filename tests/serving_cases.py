"""vLLM container shapes and what Ferry makes of them, shared by the unit tests
(test_serving.py) and the test that feeds the result to vLLM's own parser
(test_serving_vllm.py)."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from ferry_operator.api.types import Artifact, ModelWeightsSpec
from ferry_operator.api.validation import parse
from ferry_operator.serving.wiring import WorkloadFacts, template_patch
from spec_cases import manifest

HUB_ID = "meta-llama/Meta-Llama-3-70B-Instruct"
MOUNT = "/ferry/weights"
DIGEST = "sha256:" + "1" * 64
CONTAINER = "vllm"


def spec_of(obj: dict) -> ModelWeightsSpec:
    return parse(obj).spec


SPECS: dict[str, tuple[ModelWeightsSpec, Artifact]] = {
    # hf:// source, pre-sharded for TP 4 on a claim.
    "hf": (spec_of(manifest()),
           Artifact(uri="pvc://llama-weights/llama/abc", format="sharded_state", tensor_parallel_size=4,
                    manifest_digest=DIGEST)),
    # TP 2 x PP 2.
    "hf-pp": (spec_of(manifest(format={"type": "sharded_state", "tensorParallelSize": 2,
                                       "pipelineParallelSize": 2})),
              Artifact(uri="pvc://llama-weights/llama/def", format="sharded_state", tensor_parallel_size=2,
                       pipeline_parallel_size=2, manifest_digest=DIGEST)),
    # Streamed from the S3 source: nothing prepared, the model is the URI.
    "s3-runai": (spec_of(manifest(source={"uri": "s3://models/qwen", "credentialsSecretRef": {"name": "s3"}},
                                  storage=None,
                                  format={"type": "runai_streamer", "runaiStreamer": {"concurrency": 32}})),
                 Artifact(uri="s3://models/qwen", format="runai_streamer")),
    # A MoE model pre-cut for expert parallelism over TP 4, experts round robin.
    "hf-ep": (spec_of(manifest(format={"type": "sharded_state", "tensorParallelSize": 4, "expertParallel": True,
                                       "expertPlacement": "round_robin"})),
              Artifact(uri="pvc://llama-weights/llama/jkl", format="sharded_state", tensor_parallel_size=4,
                       manifest_digest=DIGEST, experts=8, expert_parallel=True, target="hopper")),
    # A plain copy from a claim.
    "pvc": (spec_of(manifest(source={"uri": "pvc://models/checkpoints/llama-70b"},
                             format={"type": "safetensors", "tensorParallelSize": 2})),
            Artifact(uri="pvc://llama-weights/llama/ghi", format="safetensors", tensor_parallel_size=2,
                     manifest_digest=DIGEST)),
}


def facts(command: list[str] | None, args: list[str], annotations: dict[str, str] | None = None,
          name: str = "llama-70b-vllm") -> WorkloadFacts:
    return WorkloadFacts(name=name, containers={"sidecar": [], CONTAINER: list(args)},
                           commands={CONTAINER: list(command)} if command else {},
                           template_annotations=dict(annotations or {}), rolled_out=True)


def apply(current: WorkloadFacts, patch: dict[str, Any] | None) -> WorkloadFacts:
    """What the API server's strategic merge makes of the fields Ferry reads
    (containers merge by name; command and args are replaced; a null annotation is removed)."""
    if patch is None:
        return current
    template = patch["spec"]["template"]
    annotations = dict(current.template_annotations)
    for key, value in template.get("metadata", {}).get("annotations", {}).items():
        if value is None:
            annotations.pop(key, None)
        else:
            annotations[key] = value
    containers, commands, envs = dict(current.containers), dict(current.commands), dict(current.envs)
    for c in template["spec"]["containers"]:
        if "args" in c:
            containers[c["name"]] = list(c["args"])
        if "command" in c:
            commands[c["name"]] = list(c["command"])
        if "env" in c:
            envs[c["name"]] = merged_env(envs.get(c["name"], []), c["env"])
    for c in template["spec"].get("initContainers") or []:  # names are unique across both lists
        if c.get("$patch") == "delete":
            envs.pop(c["name"], None)
        elif "env" in c:
            envs[c["name"]] = merged_env(envs.get(c["name"], []), c["env"])
    return replace(current, containers=containers, commands=commands, template_annotations=annotations,
                   envs=envs, weights_volume=merged_weights_volume(current, template["spec"]))


def merged_env(have: list[dict[str, Any]], patch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """env after a strategic merge: entries merge by name, `$patch: delete` removes one."""
    by_name = {e["name"]: e for e in have}
    for e in patch:
        if e.get("$patch") == "delete":
            by_name.pop(e["name"], None)
        else:  # maps merge: a key set to null goes
            merged = {**by_name.get(e["name"], {}), **e}
            by_name[e["name"]] = {k: v for k, v in merged.items() if v is not None}
    return list(by_name.values())


def merged_weights_volume(current: WorkloadFacts, pod_patch: dict[str, Any]) -> str:
    """The ferry-weights volume's source after a strategic merge: volumes merge by name, and `$retainKeys`
    (Ferry's node cache volume) keeps only the keys it lists."""
    for v in pod_patch.get("volumes") or []:
        if v.get("name") == "ferry-weights":
            return "" if v.get("$patch") == "delete" else next(k for k in v if k[0] != "$" and k != "name")
    return current.weights_volume


def wire(spec_name: str, current: WorkloadFacts) -> tuple[dict | None, WorkloadFacts]:
    spec, artifact = SPECS[spec_name]
    patch = template_patch(spec, "llama", artifact, CONTAINER, current)
    return patch, apply(current, patch)


def command_line(d: WorkloadFacts) -> tuple[list[str], list[str]]:
    return list(d.commands.get(CONTAINER, [])), list(d.containers[CONTAINER])


@dataclass(frozen=True)
class Shape:
    id: str
    command: list[str]
    args: list[str]
    want_command: list[str]
    want_args: list[str]
    spec: str = "hf"
    # What vLLM must end up with.
    model: str = MOUNT
    served: list[str] = field(default_factory=lambda: [HUB_ID])
    max_model_len: int | None = 8192
    port: int | None = None
    # Runs as is with a `vllm` / `python3` on PATH (test_serving_vllm.py).
    runnable: bool = True
    # With command empty, the image entrypoints it is run under there ("none": args are the command line).
    entrypoints: tuple[str, ...] = ()


HF_FLAGS = ["--load-format", "sharded_state", "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1"]
SERVED = ["--served-model-name", HUB_ID]
SCRIPT_FLAGS = " ".join(HF_FLAGS + SERVED)

SHAPES = [
    Shape("entrypoint-flags", [], ["--model", HUB_ID, "--max-model-len", "8192", "-tp", "2"],
          [], ["--max-model-len", "8192", "--model", MOUNT, *HF_FLAGS, *SERVED],
          entrypoints=("vllm-serve", "api-server")),
    Shape("entrypoint-positional", [], [HUB_ID, "--max-model-len", "8192", "--tensor-parallel-size=2"],
          [], [MOUNT, "--max-model-len", "8192", *HF_FLAGS, *SERVED], entrypoints=("vllm-serve",)),
    Shape("command-vllm-serve", ["vllm", "serve"], [HUB_ID, "--max-model-len", "8192", "-tp=2", "--port", "8001"],
          ["vllm", "serve"], [MOUNT, "--max-model-len", "8192", "--port", "8001", *HF_FLAGS, *SERVED], port=8001),
    Shape("command-vllm-args-serve", ["vllm"], ["serve", HUB_ID, "--max-model-len", "8192"],
          ["vllm"], ["serve", MOUNT, "--max-model-len", "8192", *HF_FLAGS, *SERVED]),
    Shape("vllm-serve-model-flag", ["vllm", "serve"], ["--max-model-len", "8192", "--model", HUB_ID],
          ["vllm", "serve"], [MOUNT, "--max-model-len", "8192", *HF_FLAGS, *SERVED]),
    Shape("model-in-command", ["vllm", "serve", HUB_ID], ["--max-model-len", "8192", "--tensor_parallel_size", "2"],
          ["vllm", "serve", MOUNT], ["--max-model-len", "8192", *HF_FLAGS, *SERVED]),
    Shape("all-in-command-absolute", ["/usr/local/bin/vllm", "serve", HUB_ID, "--max-model-len", "8192"], [],
          ["/usr/local/bin/vllm", "serve", MOUNT, "--max-model-len", "8192"], [*HF_FLAGS, *SERVED], runnable=False),
    Shape("args-are-the-command-line", [], ["vllm", "serve", HUB_ID, "--max-model-len", "8192"],
          [], ["vllm", "serve", MOUNT, "--max-model-len", "8192", *HF_FLAGS, *SERVED], entrypoints=("none",)),
    Shape("tini-wrapper", ["tini", "--", "vllm", "serve"], [HUB_ID, "--max-model-len", "8192"],
          ["tini", "--", "vllm", "serve"], [MOUNT, "--max-model-len", "8192", *HF_FLAGS, *SERVED], runnable=False),
    Shape("pipeline-parallel", ["vllm", "serve"], [HUB_ID, "--max-model-len", "8192", "-tp", "8", "-pp", "1"],
          ["vllm", "serve"], [MOUNT, "--max-model-len", "8192", "--load-format", "sharded_state",
                              "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", *SERVED],
          spec="hf-pp"),
    Shape("api-server", ["python3", "-m", "vllm.entrypoints.openai.api_server"],
          [f"--model={HUB_ID}", "--max-model-len", "8192", "-pp", "2"],
          ["python3", "-m", "vllm.entrypoints.openai.api_server"],
          ["--max-model-len", "8192", "--model", MOUNT, *HF_FLAGS, *SERVED]),
    # vLLM 0.32's api_server parses a positional and ignores it: Ferry drops it.
    Shape("api-server-positional-in-command",
          ["python", "-u", "-m", "vllm.entrypoints.openai.api_server", HUB_ID, "--max-model-len", "8192"], [],
          ["python", "-u", "-m", "vllm.entrypoints.openai.api_server", "--max-model-len", "8192"],
          ["--model", MOUNT, *HF_FLAGS, *SERVED]),
    Shape("cli-module", ["python3", "-m", "vllm.entrypoints.cli.main", "serve"], [HUB_ID, "--max-model-len", "8192"],
          ["python3", "-m", "vllm.entrypoints.cli.main", "serve"],
          [MOUNT, "--max-model-len", "8192", *HF_FLAGS, *SERVED]),
    Shape("sh-c-script",
          ["sh", "-c", f"echo starting >&2 && exec vllm serve {HUB_ID} \\\n  --max-model-len 8192 "
                       "--port ${PORT:-8002} -tp 2  # the server"], [],
          ["sh", "-c", f"echo starting >&2 && exec vllm serve {MOUNT} --max-model-len 8192 --port ${{PORT:-8002}} "
                       f"{SCRIPT_FLAGS}  # the server"], [], port=8002),
    Shape("bash-c-script-in-args", ["/bin/bash", "-c"],
          [f"set -e\nexport HF_HOME=/tmp/hf\nHOME=/tmp python3 -m vllm.entrypoints.openai.api_server "
           f"--model '{HUB_ID}' --max-model-len=8192\n", "ignored-$0"],
          ["/bin/bash", "-c"],
          [f"set -e\nexport HF_HOME=/tmp/hf\nHOME=/tmp python3 -m vllm.entrypoints.openai.api_server "
           f"--max-model-len=8192 --model {MOUNT} {SCRIPT_FLAGS}\n", "ignored-$0"]),
    Shape("sh-c-runai-s3", ["sh", "-c", "vllm serve Qwen/Qwen2.5-7B-Instruct --max-model-len 8192"], [],
          ["sh", "-c", "vllm serve s3://models/qwen --max-model-len 8192 --load-format runai_streamer "
                       "--tensor-parallel-size 1 --pipeline-parallel-size 1 "
                       "--model-loader-extra-config '{\"concurrency\": 32}' "
                       "--served-model-name Qwen/Qwen2.5-7B-Instruct"], [],
          spec="s3-runai", model="s3://models/qwen", served=["Qwen/Qwen2.5-7B-Instruct"]),
    Shape("user-served-name", ["vllm", "serve"], [HUB_ID, "--served-model-name", "llama-70b", "--max-model-len", "8192"],
          ["vllm", "serve"], [MOUNT, "--served-model-name", "llama-70b", "--max-model-len", "8192", *HF_FLAGS],
          served=["llama-70b"]),
    Shape("pvc-source-local-path", [], ["/models/llama-70b", "--max-model-len", "8192"],
          [], [MOUNT, "--max-model-len", "8192", "--load-format", "safetensors", "--tensor-parallel-size", "2",
               "--pipeline-parallel-size", "1", "--served-model-name", "/models/llama-70b"],
          spec="pvc", served=["/models/llama-70b"], entrypoints=("vllm-serve",)),
    # The user's spellings of the expert-parallel flags go; Ferry's (from format.expertParallel) stay.
    Shape("expert-parallel", ["vllm", "serve"],
          [HUB_ID, "--max-model-len", "8192", "-ep", "--expert-placement-strategy=linear", "--enforce-eager"],
          ["vllm", "serve"], [MOUNT, "--max-model-len", "8192", "--enforce-eager", *HF_FLAGS,
                              "--enable-expert-parallel", "--expert-placement-strategy", "round_robin", *SERVED],
          spec="hf-ep"),
    Shape("wrapper-script-flags", ["/scripts/start.sh"], ["--model", HUB_ID, "--max-model-len", "8192"],
          ["/scripts/start.sh"], ["--max-model-len", "8192", "--model", MOUNT, *HF_FLAGS, *SERVED], runnable=False),
]


def shape_facts(shape: Shape) -> WorkloadFacts:
    return facts(copy.copy(shape.command), copy.copy(shape.args))


# A container's own vLLM flags after `vllm serve MODEL`, and whether they ask for
# what a pre-cut MoE artifact cannot serve: data parallelism above 1 or EPLB
# (argparse keeps the last of each). test_serving_vllm.py checks that vLLM's
# own parser reads each the same way.
PARALLELISM_FLAGS = [
    (["-dp", "2"], True),
    (["--data-parallel-size", "4"], True),
    (["--data-parallel-size=2"], True),
    (["--data_parallel_size", "2"], True),
    (["-dp=2"], True),
    (["-dp", "1", "--max-model-len", "8192", "-dp", "2"], True),
    (["--enable-eplb"], True),
    (["--enable_eplb"], True),
    (["--no-enable-eplb", "--enable-eplb"], True),
    ([], False),
    (["-dp", "1"], False),
    (["--data-parallel-size", "2", "-dp", "1"], False),
    (["--enable-eplb", "--no-enable-eplb"], False),
    (["--eplb-config", '{"window_size": 1000}'], False),
]
