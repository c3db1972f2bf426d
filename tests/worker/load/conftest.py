"""Fixtures of the `ferry load` tests."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def copy_of(artifact: Path, tmp_path: Path) -> Path:
    """A copy of the module's `artifact` to damage."""
    target = tmp_path / "artifact"
    target.mkdir()
    for f in artifact.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target
