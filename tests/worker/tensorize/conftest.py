"""Fixtures for the tensorize/publish tests: the S3 environment, and the rule
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


@pytest.fixture
def s3_env(s3_server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """In-process ferry commands find the server the way a Job does: through the AWS environment."""
    env = s3_server.env()
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env
