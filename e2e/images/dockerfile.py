"""The runtime settings of worker_image/Dockerfile's final stage (USER, ENV,
ENTRYPOINT, CMD, WORKDIR), so the image built here cannot drift from the
one `docker build` makes. Only what those instructions can say is read."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RuntimeConfig:
    user: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    workdir: str | None = None


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: comments dropped, continuations joined."""
    result, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            word, _, rest = full.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def _exec_form(args: str) -> list[str]:
    if args.startswith("["):
        return json.loads(args)
    return ["/bin/sh", "-c", args]


def final_stage(path: Path) -> RuntimeConfig:
    config = RuntimeConfig()
    for word, args in instructions(path.read_text()):
        if word == "FROM":
            config = RuntimeConfig()  # a new stage; only the last one is the image
        elif word == "USER":
            config.user = args
        elif word == "ENV":
            words = shlex.split(args)
            if words and "=" not in words[0]:  # legacy form: ENV KEY value with spaces
                config.env[words[0]] = args.split(None, 1)[1]
            else:
                config.env.update(item.split("=", 1) for item in words)
        elif word == "ENTRYPOINT":
            config.entrypoint = _exec_form(args)
            config.cmd = None  # Docker: ENTRYPOINT resets an inherited CMD
        elif word == "CMD":
            config.cmd = _exec_form(args)
        elif word == "WORKDIR":
            config.workdir = args
    return config
