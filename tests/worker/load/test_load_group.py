"""`ferry load --group-size G --group-index I`: a pod of a multi-node serving
group (LeaderWorkerSet, StatefulSet) loads the ranks vLLM's multi-node launch
(`vllm serve --nnodes G --node-rank I`) gives it: [I*k, (I+1)*k), k = TP*PP/G.

A real `ferry shard` artifact (TP 2 x PP 2) of a generated checkpoint: over a
group of 2 pods, pod I is pipeline stage I; it verifies exactly that stage's
rank files plus the files of no rank, and another stage's damage is not its
concern.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from checkpoints import LLAMA3, write_checkpoint
from ferry_worker.cli import main
from ferry_worker.load import report
from ferry_worker.load.run import LoadRequest, load
from ferry_worker.load.selection import (Group, SelectionError, describe_stages, group_ranks, parse_group_index,
                                         select)
from ferry_worker.manifest import MANIFEST_NAME, FileEntry, IntegrityError, Manifest, read_manifest, write_manifest

TP, PP = 2, 2


class Recorder:
    def __init__(self) -> None:
        self.reports: list[tuple[bool, str, str]] = []

    def report(self, loaded: bool, reason: str, message: str) -> None:
        self.reports.append((loaded, reason, message))


# The arithmetic.

def vllm_ranks(world: int, nnodes: int, node_rank: int) -> list[int]:
    """vllm/engine/arg_utils.py: local_world_size = world_size // nnodes; rank = node_rank * local_world_size +
    local_rank, for each local_rank of the node."""
    local_world_size = world // nnodes
    return [node_rank * local_world_size + local_rank for local_rank in range(local_world_size)]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_pp2_over_two_pods_gives_each_pod_one_stage(tp: int):
    assert group_ranks(2 * tp, tp, 2, 0) == list(range(tp))
    assert group_ranks(2 * tp, tp, 2, 1) == list(range(tp, 2 * tp))
    assert describe_stages(group_ranks(2 * tp, tp, 2, 1), tp) == "pipeline stage 1"


def test_tp8_pp2_over_four_pods_gives_four_ranks_each():
    pods = [group_ranks(16, 8, 4, i) for i in range(4)]
    assert pods == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [describe_stages(p, 8) for p in pods] == [
        "pipeline stage 0, tensor ranks 0-3", "pipeline stage 0, tensor ranks 4-7",
        "pipeline stage 1, tensor ranks 0-3", "pipeline stage 1, tensor ranks 4-7"]


@pytest.mark.parametrize("world, tp, size", [(1, 1, 1), (4, 2, 1), (4, 2, 4), (16, 8, 2), (16, 8, 8), (12, 4, 6),
                                             (6, 3, 3)])
def test_group_ranks_is_vllms_multi_node_assignment(world: int, tp: int, size: int):
    every = [group_ranks(world, tp, size, i) for i in range(size)]
    assert every == [vllm_ranks(world, size, i) for i in range(size)]
    assert sorted(r for ranks in every for r in ranks) == list(range(world))  # each rank on exactly one pod


def test_stage_descriptions():
    assert describe_stages([0, 1, 2, 3], 2) == "pipeline stages 0-1"
    assert describe_stages([3], 2) == "pipeline stage 1, tensor rank 1"
    assert describe_stages([2, 3], 3) == "pipeline stage 0, tensor rank 2; pipeline stage 1, tensor rank 0"


def test_a_group_the_parallel_size_does_not_divide_or_an_index_outside_it_is_refused():
    with pytest.raises(SelectionError, match="tensor x pipeline parallel size 4 cannot be spread over a group of 3 "
                                             "pods: 4 must be a multiple of 3"):
        group_ranks(4, 2, 3, 0)
    with pytest.raises(SelectionError, match=r"--group-index 2 is not a pod of a group of 2 .*0\.\.1"):
        group_ranks(4, 2, 2, 2)


def test_the_group_index_arrives_as_the_kubelets_expansion():
    assert parse_group_index("0") == 0 and parse_group_index("3") == 3
    with pytest.raises(SelectionError, match=r"the env var FERRY_GROUP_INDEX was not set in this container"):
        parse_group_index("$(FERRY_GROUP_INDEX)")
    for junk in ("-1", "one", "", "1.0", "١"):
        with pytest.raises(SelectionError, match="is not a pod index"):
            parse_group_index(junk)


# A real TP 2 x PP 2 artifact.

@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("load-group")
    write_checkpoint(root / "checkpoint", LLAMA3)
    assert main(["shard", "--source", str(root / "checkpoint"), "--output", str(root / "artifact"),
                 "--tensor-parallel-size", str(TP), "--pipeline-parallel-size", str(PP)]) == 0
    return root / "artifact"


def stage_files(directory: Path, stage: int) -> set[str]:
    rank_files = read_manifest(directory).extra["rankFiles"]
    return {name for tp in range(TP) for name in rank_files[f"pp{stage}-tp{tp}"]}


def shared_files(directory: Path) -> set[str]:
    rank_files = read_manifest(directory).extra["rankFiles"]
    owned = {name for files in rank_files.values() for name in files}
    return {e.path for e in read_manifest(directory).files} - owned


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_artifact_has_two_stages_of_files(artifact: Path):
    extra = read_manifest(artifact).extra
    assert (extra["tensorParallelSize"], extra["pipelineParallelSize"]) == (TP, PP)
    assert stage_files(artifact, 0) and stage_files(artifact, 1)
    assert not stage_files(artifact, 0) & stage_files(artifact, 1)
    assert {"config.json", "tokenizer.json"} <= shared_files(artifact)


def test_a_group_pod_verifies_exactly_its_stage_and_the_shared_files(artifact: Path, tmp_path: Path, capsys,
                                                                      monkeypatch):
    result_file = tmp_path / "result"
    monkeypatch.setenv("FERRY_RESULT_FILE", str(result_file))
    local = tmp_path / "local"
    assert main(["load", "--artifact", str(artifact), "--no-report", "--group-size", "2", "--group-index", "1",
                 "--copy-to", str(local)]) == 0
    # --copy-to writes exactly the files the pod verified.
    assert {p.name for p in local.iterdir()} == stage_files(artifact, 1) | shared_files(artifact) | {MANIFEST_NAME}
    out = capsys.readouterr().out
    assert "group pod 1/2: rank 2,3 (pipeline stage 1)" in out, out
    facts = json.loads(result_file.read_text())
    assert (facts["groupSize"], facts["groupIndex"], facts["ranks"]) == (2, 1, [2, 3])
    assert facts["files"] == len(stage_files(artifact, 1) | shared_files(artifact))
    assert "group pod 1/2: rank 2,3 (pipeline stage 1)" in facts["loaded"]


def test_the_condition_names_the_group_position(artifact: Path):
    recorder = Recorder()
    result = load(LoadRequest(str(artifact), group=Group(2, 0)), recorder)
    assert result.selection.ranks == [0, 1]
    assert recorder.reports[-1][:2] == (True, "Loaded")
    assert "group pod 0/2: rank 0,1 (pipeline stage 0)" in recorder.reports[-1][2]
    # A group of 1 (and no group) says what a single-node pod always said.
    for group in (None, Group(1, 0)):
        recorder = Recorder()
        load(LoadRequest(str(artifact), group=group), recorder)
        assert "for rank 0,1,2,3 in" in recorder.reports[-1][2] and "group" not in recorder.reports[-1][2]


def test_another_stages_damage_does_not_fail_this_pod_its_own_does(copy_of: Path, caplog):
    stage0 = copy_of / sorted(stage_files(copy_of, 0))[0]
    flip_a_byte(stage0)
    # The stage-1 pod does not read stage 0's files.
    assert main(["load", "--artifact", str(copy_of), "--no-report", "--group-size", "2", "--group-index", "1"]) == 0
    # The stage-0 pod does, and names the file.
    assert main(["load", "--artifact", str(copy_of), "--no-report", "--group-size", "2", "--group-index", "0"]) == 2
    assert f"load failed: {stage0.name}: block 0" in caplog.text
    caplog.clear()

    stage1 = copy_of / sorted(stage_files(copy_of, 1))[-1]
    flip_a_byte(stage1)
    assert main(["load", "--artifact", str(copy_of), "--no-report", "--group-size", "2", "--group-index", "1"]) == 2
    assert f"load failed: {stage1.name}: block 0" in caplog.text
    recorder = Recorder()
    with pytest.raises(IntegrityError, match=stage1.name):
        load(LoadRequest(str(copy_of), group=Group(2, 1)), recorder)
    assert recorder.reports[-1][:2] == (False, "VerificationFailed") and stage1.name in recorder.reports[-1][2]


# Refusals.

def test_ranks_and_a_group_position_are_exclusive(artifact: Path, capsys):
    for extra in (["--group-size", "2", "--group-index", "0"], ["--group-index", "0"]):
        with pytest.raises(SystemExit) as exit:
            main(["load", "--artifact", str(artifact), "--no-report", "--ranks", "0,1", *extra])
        assert exit.value.code == 2
        assert "--ranks and --group-size/--group-index are mutually exclusive" in capsys.readouterr().err


def test_a_group_needs_the_pods_index(artifact: Path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["load", "--artifact", str(artifact), "--no-report", "--group-size", "2"])
    assert exit.value.code == 2
    assert "--group-size 2 needs --group-index" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:
        main(["load", "--artifact", str(artifact), "--no-report", "--group-size", "0", "--group-index", "0"])
    assert exit.value.code == 2


@pytest.fixture
def recorder(monkeypatch) -> Recorder:
    """The pod condition the command would set, as if in a pod Ferry wired."""
    recorder = Recorder()
    monkeypatch.setattr(report, "reporter_for", lambda no_report: recorder)
    return recorder


@pytest.mark.parametrize("size, index, message", [
    ("3", "0", "tensor x pipeline parallel size 4 cannot be spread over a group of 3 pods: 4 must be a multiple of 3"),
    ("2", "2", "--group-index 2 is not a pod of a group of 2"),
    ("2", "$(FERRY_GROUP_INDEX)", "the env var FERRY_GROUP_INDEX was not set in this container"),
])
def test_a_group_position_the_artifact_cannot_have_is_a_bad_request(artifact: Path, tmp_path: Path, monkeypatch,
                                                                    caplog, recorder: Recorder, size: str,
                                                                    index: str, message: str):
    result_file = tmp_path / "result"
    monkeypatch.setenv("FERRY_RESULT_FILE", str(result_file))
    assert main(["load", "--artifact", str(artifact), "--group-size", size, "--group-index", index]) == 2
    assert message in caplog.text
    assert result_file.read_text().startswith("load failed: ") and message in result_file.read_text()
    # The pod condition says it too (LoadFailed: the request, not the files, is wrong).
    assert recorder.reports[-1][:2] == (False, "LoadFailed") and message in recorder.reports[-1][2]
    assert "\n" not in recorder.reports[-1][2]


# A format without per-rank files: every pod of the group reads every file.

def test_without_rank_files_every_group_pod_reads_every_file(tmp_path: Path):
    files = {"config.json": b"{}", "model-00001-of-00002.safetensors": b"a" * 100,
             "model-00002-of-00002.safetensors": b"b" * 50}
    entries = []
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        entries.append(FileEntry(name, len(data), hashlib.sha256(data).hexdigest()))
    write_manifest(tmp_path, Manifest(entries, format="safetensors",
                                      extra={"tensorParallelSize": 2, "pipelineParallelSize": 2}))
    manifest = read_manifest(tmp_path)
    # Even a group the parallel size does not divide: the group changes nothing here.
    for group in (Group(2, 1), Group(3, 2)):
        selection = select(manifest, None, group)
        assert {e.path for e in selection.entries} == set(files) and selection.ranks is None
    recorder = Recorder()
    load(LoadRequest(str(tmp_path), group=Group(2, 1)), recorder)
    assert "group pod 1/2: all files (this format has no per-rank files: every pod of the group reads them all)" \
        in recorder.reports[-1][2]
    with pytest.raises(SelectionError, match="--group-index 2 is not a pod of a group of 2"):
        select(manifest, None, Group(2, 2))
