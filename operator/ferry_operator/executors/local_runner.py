"""Runs one worker step for the local executor and records its exit status.

    python -m ferry_operator.executors.local_runner STATE_DIR [--lock-fd N] -- ferry ARGS...

The exit code lands in STATE_DIR/rc (written atomically) so the operator can
tell success from failure even if it restarted while the step ran. The lock
the operator took on STATE_DIR/lock (fd N) is held by this runner and the
worker until both are done: while it is held, the step is running.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    state = Path(sys.argv[1])
    own = sys.argv[2:sys.argv.index("--")]
    lock_fd = [int(own[own.index("--lock-fd") + 1])] if "--lock-fd" in own else []
    argv = sys.argv[sys.argv.index("--") + 1:]
    with open(state.parent / f"{state.name}.launches", "a") as launches:  # one line per worker started
        launches.write(f"{os.getpid()}\n")
    with open(state / "log", "ab") as log:
        rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             pass_fds=lock_fd)
    tmp = state / "rc.tmp"
    tmp.write_text(str(rc))
    os.replace(tmp, state / "rc")  # written while the lock is still held
    return rc


if __name__ == "__main__":
    sys.exit(main())
