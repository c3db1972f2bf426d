"""Runs one worker step for the local executor and records its exit status.

    python -m ferry_operator.executors.local_runner STATE_DIR -- ferry ARGS...

The exit code lands in STATE_DIR/rc (written atomically) so the operator can
tell success from failure even if it restarted while the step ran.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def main() -> int:
    state = Path(sys.argv[1])
    argv = sys.argv[sys.argv.index("--") + 1:]
    with open(state / "log", "ab") as log:
        rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    tmp = state / "rc.tmp"
    tmp.write_text(str(rc))
    os.replace(tmp, state / "rc")
    return rc


if __name__ == "__main__":
    sys.exit(main())
