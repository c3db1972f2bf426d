"""`ferry shard` / `ferry unshard` argument wiring, end to end on a small checkpoint."""
from __future__ import annotations

import argparse
import logging

import pytest

from ferry_worker.manifest import verify
from ferry_worker.shard.cli import add_shard_commands

from checkpoints import QWEN3, read_safetensors


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ferry")
    add_shard_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.run(args)


def test_shard_then_unshard(make_checkpoint, tmp_path, caplog):
    source, weights = make_checkpoint(QWEN3)
    out, rebuilt = tmp_path / "tp2pp2", tmp_path / "rebuilt"
    with caplog.at_level(logging.INFO):
        assert _run(["shard", "--source", str(source), "--output", str(out), "--tensor-parallel-size", "2",
                     "--pipeline-parallel-size", "2", "--vllm-version", "0.32", "--max-part-size", "64Ki",
                     "--pp-layer-partition", "1,2", "--jobs", "2"]) == 0
    assert "shard:" in caplog.text and "done" in caplog.text  # the progress step's final line
    manifest = verify(out)
    assert manifest.extra["ppLayerPartition"] == [1, 2]
    assert any("-part-1." in e.path for e in manifest.files)
    assert _run(["unshard", str(out), "--output", str(rebuilt)]) == 0
    assert read_safetensors(rebuilt / "model.safetensors") == {n: tuple(w) for n, w in weights.items()}


def test_a_fetched_source_manifest_is_not_carried_into_the_artifact(make_checkpoint, tmp_path):
    """`ferry fetch` leaves its manifest in the staging directory the shard step reads."""
    from ferry_worker.manifest import Manifest, write_manifest

    source, _ = make_checkpoint(QWEN3)
    write_manifest(source, Manifest(files=[], source="file:///elsewhere"))
    out = tmp_path / "tp2"
    assert _run(["shard", "--source", str(source), "--output", str(out), "-tp", "2"]) == 0
    manifest = verify(out)
    assert "ferry-manifest.json" not in {e.path for e in manifest.files}


@pytest.mark.parametrize("argv", [
    ["shard", "--source", "s", "--output", "o", "--tensor-parallel-size", "0"],
    ["shard", "--source", "s", "--output", "o", "-tp", "2", "--max-part-size", "lots"],
    ["shard", "--source", "s", "--output", "o", "-tp", "2", "--pp-layer-partition", "1,x"],
])
def test_bad_arguments_are_rejected_by_the_parser(argv):
    with pytest.raises(SystemExit):
        _run(argv)
