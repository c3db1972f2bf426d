"""Run a command in a root filesystem assembled from layer directories, the
way a container runtime stacks them, without leaving anything mounted.

    run(lowers=[deps_dir, base_dir], cmds=[[...], ...], upper=new_layer_dir, inputs=wheels_dir)

The root is an overlay of the lowers (first = topmost); with an upper
directory every write lands there, so afterwards the upper *is* the new layer
(layers.py turns it into one); without one the root is read-only. /proc, /dev
(the host's), a fresh tmpfs on /tmp and, optionally, a read-only bind of
inputs on /mnt are mounted on top. All of it happens in a private mount
namespace (`unshare --mount`): the kernel drops every mount when the command
exits, however it exits; nothing reaches the host's mount table.

Needs root (mount, chroot). This file is also the helper that runs inside the
namespace: `python sandbox.py SPEC_JSON`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               "LANG": "C.UTF-8", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
# No index, no metacopy, no redirects: every change is a whole file or
# directory in the upper dir, which is what a layer tar can say.
OVERLAY_OPTIONS = "index=off,metacopy=off,redirect_dir=off"


def run(lowers: list[Path], cmds: list[list[str]], *, upper: Path | None = None, inputs: Path | None = None,
        user: str | None = None, env: dict[str, str] | None = None, scratch: Path | None = None,
        capture: bool = False) -> subprocess.CompletedProcess:
    """Run each of cmds in turn (stop at the first failure) in one mount of the root.

    user: "uid:gid" to run as (default root); env: the whole environment
    (default DEFAULT_ENV); scratch: where the overlay's mount point and work
    dir go (must be on upper's filesystem; default: beside upper).
    """
    scratch = scratch or (upper.parent if upper else Path(tempfile.gettempdir()))
    spec = {"lowers": [str(p) for p in lowers], "upper": str(upper) if upper else None,
            "inputs": str(inputs) if inputs else None, "user": user, "env": env or DEFAULT_ENV, "cmds": cmds}
    with tempfile.TemporaryDirectory(prefix="sandbox-", dir=scratch) as tmp:
        spec["scratch"] = tmp
        # Output goes to stderr unless captured: build.py's stdout is its JSON.
        return subprocess.run(["unshare", "--mount", "--propagation", "private",
                               sys.executable, __file__, json.dumps(spec)],
                              check=not capture, text=True,
                              stdout=subprocess.PIPE if capture else 2,
                              stderr=subprocess.PIPE if capture else None)


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def _inside(spec: dict) -> int:
    """In the private mount namespace: mount the root, then run the commands chrooted."""
    merged = Path(spec["scratch"]) / "root"
    merged.mkdir()
    lowers = spec["lowers"]
    if spec["upper"]:
        work = Path(spec["scratch"]) / "work"
        work.mkdir()
        _mount("-t", "overlay", "overlay", "-o",
               f"lowerdir={':'.join(lowers)},upperdir={spec['upper']},workdir={work},{OVERLAY_OPTIONS}", str(merged))
    elif len(lowers) > 1:
        _mount("-t", "overlay", "overlay", "-o", f"lowerdir={':'.join(lowers)}", str(merged))  # read-only
    else:
        _mount("--bind", lowers[0], str(merged))
        _mount("-o", "remount,bind,ro", str(merged))
    _mount("-t", "proc", "proc", str(merged / "proc"))
    _mount("--rbind", "/dev", str(merged / "dev"))
    _mount("-t", "tmpfs", "-o", "mode=1777", "tmpfs", str(merged / "tmp"))
    if spec["inputs"]:
        _mount("--bind", spec["inputs"], str(merged / "mnt"))
        _mount("-o", "remount,bind,ro", str(merged / "mnt"))
    for cmd in spec["cmds"]:
        pid = os.fork()
        if pid == 0:
            os.chroot(merged)
            os.chdir("/")
            if spec["user"]:
                uid, gid = (int(x) for x in spec["user"].split(":"))
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
            try:
                os.execvpe(cmd[0], cmd, spec["env"])
            except OSError as exc:
                print(f"sandbox: {cmd[0]}: {exc}", file=sys.stderr)
                os._exit(127)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"sandbox: {' '.join(cmd)} exited {code}", file=sys.stderr)
            return code if code > 0 else 128 - code
    return 0


if __name__ == "__main__":
    sys.exit(_inside(json.loads(sys.argv[1])))
