"""Every import package on disk ships in the wheel (pyproject lists them: two
source roots need package-dir, which find-packages cannot follow)."""
from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_pyproject_lists_every_package():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = set()
    for top, root in config["package-dir"].items():
        for init in (REPO / root).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / root)
            on_disk.add(".".join((top, *rel.parts)))
    assert set(config["packages"]) == on_disk


def test_the_workers_version_is_the_projects():
    import ferry_worker

    assert ferry_worker.__version__ == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
