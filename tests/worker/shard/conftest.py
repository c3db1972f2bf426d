"""Fixtures for the sharding tests: small generated checkpoints."""
from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import ModelCase, write_checkpoint


@pytest.fixture
def make_checkpoint(tmp_path: Path):
    """make_checkpoint(case, **edits) -> (directory, weights); `edits` go to write_checkpoint."""
    def make(case: ModelCase, name: str = "checkpoint", **edits) -> tuple[Path, dict]:
        directory = tmp_path / name
        return directory, write_checkpoint(directory, case, **edits)
    return make
