#!/usr/bin/env python3
"""`make test`: the suite as two pytest processes side by side, one per lane (tests/conftest.py `lane`).

The cluster lane (every test that needs the local cluster or the node's containerd) spends most of its time
waiting on pods, Jobs and reconciles; the local lane (the worker's vLLM breadth suites, unit, S3 and cache
tests) on the CPU. On two cores they overlap. Each lane is the same pytest session it was inside one process:
the cluster lane still has one cluster, in collection order.

    tests/lanes.py [PYTEST_ARGS...]      both lanes; the cluster lane's output live, the local lane's after it
    FERRY_TEST_LANES=0 tests/lanes.py    one pytest process, as before

Exit status: 0 when both pass (a lane the arguments leave empty counts as passed), else the first failure's.
pytest-xdist would be the library for this, but its loadgroup scheduling cannot group by mark under
pytest 9.2 (it rewrites a node id attribute pytest no longer reads).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOG_DIR = REPO / ".ferry" / "lanes"
NO_TESTS = 5  # pytest's exit status when nothing was selected


def pytest_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *args]


def run_lanes(args: list[str]) -> int:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / "local.log"
    with open(log, "w") as out:
        local = subprocess.Popen(pytest_argv(args), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "FERRY_TEST_LANE": "local"})
        try:
            cluster = subprocess.run(pytest_argv(args), cwd=REPO, env={**os.environ, "FERRY_TEST_LANE": "cluster"})
        finally:
            local_rc = local.wait()
    print(f"\n===== the local lane (its output, from {log.relative_to(REPO)}) =====", flush=True)
    sys.stdout.write(log.read_text(errors="replace"))
    codes = {"cluster": cluster.returncode, "local": local_rc}
    print(f"===== lanes: {', '.join(f'{name} exit {rc}' for name, rc in codes.items())} =====", flush=True)
    failed = [rc for rc in codes.values() if rc not in (0, NO_TESTS)]
    if failed:
        return failed[0]
    return NO_TESTS if all(rc == NO_TESTS for rc in codes.values()) else 0


def main() -> int:
    args = sys.argv[1:]
    if os.environ.get("FERRY_TEST_LANES", "1") == "0":
        return subprocess.run(pytest_argv(args), cwd=REPO).returncode
    return run_lanes(args)


if __name__ == "__main__":
    sys.exit(main())
