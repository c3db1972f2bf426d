"""`ferry tensorize` refuses a config.json its checkpoint contradicts before anything is sized by it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoints import LLAMA3, write_checkpoint
from ferry_worker.tensorize.errors import ArtifactError
from ferry_worker.tensorize.tensorize import TensorizeJob


def test_a_billion_layers_is_refused_for_the_vllm_layout(tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    write_checkpoint(source, LLAMA3)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1_000_000_000}))
    with pytest.raises(ArtifactError, match="config.json: num_hidden_layers is 1000000000, but the checkpoint "
                                            r"holds 3 layer\(s\), numbered 0 to 2"):
        TensorizeJob.prepare(source, str(tmp_path / "out"), layout="vllm", tp=1)
    assert not (tmp_path / "out").exists()
