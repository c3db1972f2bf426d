"""Serving wiring without a cluster: each vLLM container shape, patched and re-patched."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ferry_operator.api.validation import parse
from ferry_operator.planner import ArtifactFacts, Observed, StepPhase, StepState, plan
from ferry_operator.serving.wiring import (
    DIGEST_ANNOTATION, SERVED_NAME_ANNOTATION, ServingError, template_patch, served_model_name,
)
from ferry_operator.steps import prepare_steps
from serving_cases import (
    CONTAINER, HF_FLAGS, HUB_ID, MOUNT, SHAPES, SPECS, Shape, apply, command_line, facts, shape_facts, spec_of, wire,
)
from spec_cases import manifest


def container_patch(patch: dict) -> dict:
    (c,) = patch["spec"]["template"]["spec"]["containers"]
    assert c["name"] == CONTAINER
    return c


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
def test_each_shape_puts_the_artifact_where_vllm_reads_it(shape: Shape):
    patch, wired = wire(shape.spec, shape_facts(shape))
    c = container_patch(patch)
    assert command_line(wired) == (shape.want_command, shape.want_args)
    # command is sent only when it changes (a strategic merge replaces the whole list).
    assert ("command" in c) == (shape.want_command != shape.command)
    annotations = patch["spec"]["template"]["metadata"]["annotations"]
    user_named = shape.id == "user-served-name"
    assert annotations.get(SERVED_NAME_ANNOTATION) == (None if user_named else shape.served[0])
    assert SERVED_NAME_ANNOTATION not in annotations or not user_named


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.id)
def test_rewiring_a_wired_container_changes_nothing(shape: Shape):
    _, wired = wire(shape.spec, shape_facts(shape))
    again, same = wire(shape.spec, wired)
    assert again is None and same == wired
    # A new artifact with the same flags: only the digest changes (one roll, same command line).
    spec, artifact = SPECS[shape.spec]
    newer = artifact.model_copy(update={"uri": artifact.uri.replace("/abc", "/xyz"), "manifest_digest":
                                        "sha256:" + "2" * 64})
    patch = template_patch(spec, "llama", newer, CONTAINER, wired)
    rolled = apply(wired, patch)
    assert patch["spec"]["template"]["metadata"]["annotations"][DIGEST_ANNOTATION] in (
        newer.manifest_digest, newer.uri)
    assert command_line(rolled) == command_line(wired)
    assert template_patch(spec, "llama", newer, CONTAINER, rolled) is None


def test_a_flag_change_rewires_once_and_keeps_the_served_name():
    shape = next(s for s in SHAPES if s.id == "sh-c-runai-s3")
    _, wired = wire(shape.spec, shape_facts(shape))
    spec, artifact = SPECS[shape.spec]
    tp2 = spec.model_copy(update={"format": spec.format.model_copy(update={"tensor_parallel_size": 2})})
    changed = apply(wired, template_patch(tp2, "llama", artifact, CONTAINER, wired))
    command, _ = command_line(changed)
    assert "--tensor-parallel-size 2 " in command[2]
    # The user's Hub id is gone from the command line; the name Ferry chose stays.
    assert command[2].endswith("--served-model-name Qwen/Qwen2.5-7B-Instruct")
    assert template_patch(tp2, "llama", artifact, CONTAINER, changed) is None


def test_served_name_follows_an_hf_source_and_rolls_once():
    shape = next(s for s in SHAPES if s.id == "command-vllm-serve")
    _, wired = wire(shape.spec, shape_facts(shape))
    spec, artifact = SPECS["hf"]
    other = spec.model_copy(update={"source": spec.source.model_copy(
        update={"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"})})
    patch = template_patch(other, "llama", artifact, CONTAINER, wired)
    moved = apply(wired, patch)
    _, args = command_line(moved)
    assert args[-2:] == ["--served-model-name", "meta-llama/Llama-3.1-70B-Instruct"]
    assert args.count("--served-model-name") == 1
    assert moved.template_annotations[SERVED_NAME_ANNOTATION] == "meta-llama/Llama-3.1-70B-Instruct"
    assert template_patch(other, "llama", artifact, CONTAINER, moved) is None


def test_a_served_name_the_user_sets_later_is_theirs():
    shape = next(s for s in SHAPES if s.id == "command-vllm-serve")
    _, wired = wire(shape.spec, shape_facts(shape))
    command, args = command_line(wired)
    i = args.index("--served-model-name")
    edited = facts(command, args[:i] + ["--served-model-name", "llama", "llama-70b"],
                   wired.template_annotations)
    patch, rewired = wire("hf", edited)
    assert patch["spec"]["template"]["metadata"]["annotations"][SERVED_NAME_ANNOTATION] is None  # removed
    args = command_line(rewired)[1]
    assert args.count("--served-model-name") == 1
    i = args.index("--served-model-name")
    assert args[i + 1:i + 3] == ["llama", "llama-70b"]
    assert SERVED_NAME_ANNOTATION not in rewired.template_annotations
    assert wire("hf", rewired)[0] is None


@pytest.mark.parametrize("source,user_model,ferry_set,name", [
    ("hf://meta-llama/Meta-Llama-3-70B-Instruct", "/models/x", None, HUB_ID),
    ("hf://meta-llama/Meta-Llama-3-70B-Instruct", None, "old-name", HUB_ID),
    ("s3://models/llama", HUB_ID, None, HUB_ID),
    ("s3://models/llama", MOUNT, "chosen", "chosen"),
    ("s3://models/llama", "/models/llama-70b", None, "/models/llama-70b"),
    ("s3://models/prefix/llama-70b/", None, None, "llama-70b"),
    ("s3://models/llama", MOUNT, None, "llama"),  # an earlier Ferry's mount is not the user's name
    ("pvc://checkpoints", None, None, "checkpoints"),
    ("file:///srv/models/qwen", None, None, "qwen"),
])
def test_served_model_name(source, user_model, ferry_set, name):
    spec = spec_of(manifest(source={"uri": source}, format={"type": "safetensors"}))
    assert served_model_name(spec, user_model, ferry_set) == name


def test_an_s3_source_keeps_the_users_hub_id_across_rewiring():
    # Ferry decides a non-Hub source's name on first wiring, while the user's model is there to read.
    shape = next(s for s in SHAPES if s.id == "pvc-source-local-path")
    _, wired = wire("pvc", shape_facts(shape))
    assert wired.template_annotations[SERVED_NAME_ANNOTATION] == "/models/llama-70b"
    assert command_line(wired)[1][0] == MOUNT
    assert wire("pvc", wired)[0] is None


def test_shell_script_keeps_everything_but_the_vllm_words():
    script = ("set -eu\n# warm the cache\nhuggingface-cli download \"$MODEL_ID\" || true\n"
              "exec vllm serve meta-llama/Meta-Llama-3-70B-Instruct --port \"$PORT\" --download-dir ~/cache "
              "--chat-template '/t/a b.jinja'\necho unreachable")
    _, wired = wire("hf", facts(["/bin/sh", "-c", script], []))
    (new,) = command_line(wired)[0][2:]
    head, tail = script.split("exec vllm serve", 1)
    assert new.startswith(head + "exec vllm serve /ferry/weights --port \"$PORT\" --download-dir ~/cache "
                          "--chat-template '/t/a b.jinja' " + " ".join(HF_FLAGS))
    assert new.endswith("\necho unreachable")


@pytest.mark.parametrize("command,args,says", [
    (["sh", "-c", "vllm serve $MODEL --max-model-len 8192"], [], "`$MODEL`, which the shell expands"),
    (["sh", "-c", 'exec vllm serve "$@"', "sh"], [HUB_ID], "`\"$@\"`, which the shell expands"),
    (["sh", "-c", "vllm serve --model=${MODEL}"], [], "`${MODEL}`"),
    ([], ["$(MODEL_ID)", "--port", "8000"], "Kubernetes expands from the container's env"),
    (["sh", "-c", f"vllm serve {HUB_ID} 2>&1 | tee /log/vllm"], [], "joined to others with `>& |`"),
    (["sh", "-c", f"vllm serve {HUB_ID} || sleep 3600"], [], "`||`"),
    (["sh", "-c", f"vllm serve {HUB_ID} & wait"], [], "`&`"),
    (["sh", "-c", f"(cd /tmp; vllm serve {HUB_ID})"], [], "`)`"),
    (["sh", "-c", f"if [ -d /m ]; then vllm serve /m; else vllm serve {HUB_ID}; fi"], [], "compound command (`if"),
    (["sh", "-c", f"vllm serve {HUB_ID}; vllm serve other"], [], "runs vLLM 2 times"),
    (["sh", "-c", "python3 /app/server.py"], [], "no literal `vllm serve`"),
    (["sh", "-c", "$VLLM serve x"], [], "no literal `vllm serve`"),
    (["sh", "-c", f"sh -c 'vllm serve {HUB_ID}'"], [], "another shell script"),
    (["sh", "-c", f"vllm serve '{HUB_ID}"], [], "unterminated ' quote"),
    (["bash", "-c", "cat <<EOF > /c.yaml\nmodel: x\nEOF\nvllm serve --config /c.yaml"], [], "here-document"),
    (["sh", "-c", "vllm bench serve"], [], "runs `vllm bench`, not `vllm serve`"),
    (["vllm", "chat"], [], "runs `vllm chat`, not `vllm serve`"),
    (["python3", "-m", "vllm.entrypoints.api_server"], ["--model", HUB_ID], "does not know as vLLM's server"),
    (["/scripts/start.sh"], [HUB_ID, "--port", "8000"], "cannot tell where the model goes"),
])
def test_shapes_ferry_cannot_rewrite_safely_are_refused_naming_the_shape(command, args, says):
    with pytest.raises(ServingError) as err:
        wire("hf", facts(command, args))
    message = str(err.value)
    assert message.startswith("deployment llama-70b-vllm container 'vllm'")
    assert says in message


def test_a_refused_shape_stalls_the_modelweights_with_what_to_do():
    m = parse({**manifest(), "metadata": {"name": "llama", "generation": 1}})
    done = {s.id: StepState(StepPhase.SUCCEEDED) for s in prepare_steps(m.spec)}
    facts_ = ArtifactFacts(uri="pvc://llama-weights/llama/abc", total_bytes=1, manifest_digest="sha256:" + "0" * 64)
    deployment = facts(["sh", "-c", f"vllm serve {HUB_ID} | tee /log"], [])
    p = plan(m, Observed(steps=done, artifact=facts_, workloads={"llama-70b-vllm": deployment}))
    stalled = next(c for c in p.status.conditions if c.type == "Stalled")
    assert (stalled.status, stalled.reason) == ("True", "ServingError")
    assert "`sh -c` script in command" in stalled.message and "run vLLM directly" in stalled.message
    assert p.actions == []


def test_only_the_named_container_is_read_and_patched():
    d = facts(["vllm", "serve"], [HUB_ID])
    # The sidecar's script would be refused if Ferry read it.
    d = replace(d, commands={**d.commands, "sidecar": ["sh", "-c", "vllm serve x | tee"]})
    patch, _ = wire("hf", d)
    assert [c["name"] for c in patch["spec"]["template"]["spec"]["containers"]] == [CONTAINER]


def test_deployment_facts_from_the_api_json():
    from ferry_operator.serving.wiring import deployment_facts

    body = {"metadata": {"name": "vllm", "generation": 3},
            "spec": {"replicas": 2, "template": {"metadata": {"annotations": {"a": "b"}}, "spec": {"containers": [
                {"name": "vllm", "command": ["vllm", "serve"], "args": ["m", "-tp", "2"]}, {"name": "side"}]}}},
            "status": {"observedGeneration": 3, "updatedReplicas": 2, "replicas": 2, "availableReplicas": 2}}
    facts = deployment_facts(body)
    assert facts.containers == {"vllm": ["m", "-tp", "2"], "side": []}
    assert facts.commands == {"vllm": ["vllm", "serve"], "side": []}
    assert facts.template_annotations == {"a": "b"} and facts.rolled_out
    body["status"]["replicas"] = 3  # an old pod is still there
    assert not deployment_facts(body).rolled_out
    body["status"]["replicas"], body["status"]["observedGeneration"] = 2, 2  # the controller has not seen gen 3
    assert not deployment_facts(body).rolled_out
