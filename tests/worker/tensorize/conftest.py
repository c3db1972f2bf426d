"""Fixtures for the tensorize/publish tests (the S3 environment is tests/worker/conftest.py's): the rule
that tests needing torch and tensorizer (modules with
`pytestmark = pytest.mark.tensorize`) fail, never skip, when the `tensorize`
extra is not installed."""
from __future__ import annotations

import importlib.util

import pytest



@pytest.fixture(autouse=True)
def _tensorize_extra(request):
    if request.node.get_closest_marker("tensorize") is None:
        return
    missing = [m for m in ("torch", "tensorizer") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"{', '.join(missing)} not installed: install the tensorize extra "
                    f"(pip install -e '.[operator,worker,test,tensorize]')")
