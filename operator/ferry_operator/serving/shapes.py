"""Where vLLM reads its model from: the container shapes Ferry recognises. Pure.

A container's argv is its `command` followed by its `args` (with `command`
empty, the image's entrypoint runs with `args`). Ferry recognises:

- `vllm serve [MODEL] ...` — the model is the first positional argument after
  `serve` (vLLM 0.32: "If model is specified in CLI (as positional arg), it
  takes precedence"). Ferry writes its model there and drops any `--model`.
  Also `python -m vllm.entrypoints.cli.main serve ...`.
- `python[3] -m vllm.entrypoints.openai.api_server --model ...` (and
  `vllm.entrypoints.launchers.api_server.entry`) — `--model`; a positional is
  dropped (vLLM 0.32's api_server parses it and ignores it, older ones refuse it).
- a shell script: `sh|bash ... -c SCRIPT` whose one vLLM command is one of the
  above, in a flat list of commands (`;`, `&&`, newlines). Only that command's
  words are rewritten; everything else in the script stays byte for byte.
- `command` empty: `args[0]` not starting with `-` is the positional model of
  the image's `vllm serve` entrypoint (recent vllm/vllm-openai images run
  `vllm serve`; older ones ran the api_server, which does not load a
  positional model, so one there only ever worked with `vllm serve`). Flags
  only: `--model`, which both entrypoints read.
- any other program with flags only (a wrapper script that passes its
  arguments to vLLM): `--model`, as for an entrypoint.

With `command` empty, `args` that begin with a recognised program are the
whole command line (an image without an entrypoint, or one that execs its
arguments). `exec`, `env`, `nohup`, `time`, `tini`/`dumb-init` (with their
options) and `NAME=value` words may come before the program.

Ferry's flags go last, so they also win over any spelling of them Ferry did
not strip (an abbreviation, a `--config` file, a shell variable expanding to
flags): argparse keeps the last value.

Not seen: a model given after other flags (`vllm serve --enforce-eager MODEL`;
vLLM documents `vllm serve [model_tag] [options]`) stays beside Ferry's
positional, and vLLM then exits with "unrecognized arguments" — loud, never a
silent Hub download; a `served-model-name` inside a `--config` file (Ferry's
flag wins over it).
"""
from __future__ import annotations

import posixpath
import re
import shlex
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence


class ServingError(Exception):
    """The Deployment cannot be wired as asked (e.g. the named container is missing)."""

    reason = "ServingError"  # the Stalled condition's reason


class ParallelismUnsupported(ServingError):
    """The container asks vLLM for a parallelism the artifact's rank files cannot serve."""

    reason = "ParallelismUnsupported"


MODEL_FLAG = "--model"
SERVED_NAME_FLAG = "--served-model-name"

# vLLM flags whose value Ferry decides; a user's value is dropped (aliases included).
# vLLM reads `--flag_name` as `--flag-name`; _flag() normalises the same way.
MANAGED_FLAGS = {
    "--model": "--model",
    "--load-format": "--load-format",
    "--tensor-parallel-size": "--tensor-parallel-size",
    "-tp": "--tensor-parallel-size",
    "--pipeline-parallel-size": "--pipeline-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "--model-loader-extra-config": "--model-loader-extra-config",
    "--expert-placement-strategy": "--expert-placement-strategy",
}
# Switches (no value) Ferry decides from format.expertParallel, both spellings
# of vLLM's BooleanOptionalAction: a user's is dropped, so the flag is Ferry's alone.
MANAGED_SWITCHES = frozenset({"--enable-expert-parallel", "-ep", "--no-enable-expert-parallel"})
# vLLM's multi-node flags (its multiprocessing backend: --nnodes/--node-rank/--master-addr, workers
# --headless). Ferry decides them only for a workload whose pods form a group (ServingTarget.groupSize > 1),
# and removes its own once it no longer does; otherwise they are the user's.
GROUP_FLAGS = frozenset({"--nnodes", "-n", "--node-rank", "-r", "--master-addr"})
GROUP_SWITCHES = frozenset({"--headless"})

API_SERVER_MODULES = frozenset({"vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry"})
CLI_MODULE = "vllm.entrypoints.cli.main"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})
WRAPPERS = frozenset({"exec", "env", "nohup", "time", "tini", "dumb-init"})
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_K8S_VAR = re.compile(r"(?<!\$)\$\([A-Za-z_][A-Za-z0-9_]*\)")  # $(VAR) in command/args: the kubelet expands it
_PY_OPTS_WITH_VALUE = frozenset({"-X", "-W"})
_SHELL_OPTS_WITH_VALUE = frozenset({"-o", "+o", "-O", "+O", "--rcfile", "--init-file"})
# A simple command starting with one of these is part of a compound command.
_RESERVED = frozenset({"if", "then", "else", "elif", "fi", "do", "done", "case", "esac", "while", "until", "for",
                       "in", "select", "function", "{", "}", "!", "[[", "]]"})
_SEPARATORS = frozenset({";", "\n", "&&"})


@dataclass(frozen=True)
class Tok:
    """One argv word. `raw`: its text in a shell script (None: not from a script,
    or new). `literal`: False when the shell would expand it ($VAR, $(..), `..`,
    globs, ~) or the kubelet would ($(VAR) in command/args), so `value` is not
    what the program receives. `origin`: 0 command, 1 args."""

    value: str
    raw: str | None = None
    literal: bool = True
    origin: int = 1


def _flag(word: str) -> str:
    """`--tensor_parallel_size=2` -> `--tensor-parallel-size`; non-flags -> ''."""
    if not word.startswith("-"):
        return ""
    key = word.split("=", 1)[0]
    return "--" + key[2:].replace("_", "-") if key.startswith("--") else key


def _is_flag(tok: Tok) -> bool:
    return tok.value.startswith("-")


def _strip(toks: list[Tok], served_too: bool, group: bool = False) -> list[Tok]:
    """Drop Ferry-managed flags with their values (`--flag v` and `--flag=v`);
    with served_too, also `--served-model-name` (it takes one or more values);
    with group, also vLLM's multi-node flags (GROUP_FLAGS, GROUP_SWITCHES)."""
    out: list[Tok] = []
    i = 0
    while i < len(toks):
        tok = toks[i]
        flag = _flag(tok.value)
        if flag in MANAGED_SWITCHES or (group and flag in GROUP_SWITCHES):
            i += 1
            continue
        if flag in MANAGED_FLAGS or (group and flag in GROUP_FLAGS):
            i += 1 if "=" in tok.value else 2
            continue
        if served_too and flag == SERVED_NAME_FLAG:
            i += 1
            if "=" not in tok.value:
                while i < len(toks) and not _is_flag(toks[i]):
                    i += 1
            continue
        out.append(tok)
        i += 1
    return out


def _flag_value(toks: list[Tok], flag: str) -> Tok | None:
    """The first value of `flag` (vLLM's `serve` takes the first `--model`)."""
    for i, tok in enumerate(toks):
        if _flag(tok.value) == flag:
            if "=" in tok.value:
                raw = tok.raw.split("=", 1)[-1] if tok.raw is not None else None
                return Tok(tok.value.split("=", 1)[1], raw=raw, literal=tok.literal, origin=tok.origin)
            return toks[i + 1] if i + 1 < len(toks) else None
    return None


class FlagUse(NamedTuple):
    name: str  # normalised: `--data_parallel_size=2` -> `--data-parallel-size`
    word: str  # as written
    value: Tok | None  # None for a switch, or a flag that ends the line


def last_flag(toks: Sequence[Tok], names: frozenset[str]) -> FlagUse | None:
    """The last use of any of `names` (normalised spellings) among vLLM's arguments
    (argparse keeps the last); None if there is none."""
    found = None
    for i, tok in enumerate(toks):
        name = _flag(tok.value)
        if name not in names:
            continue
        if "=" in tok.value:
            raw = tok.raw.split("=", 1)[-1] if tok.raw is not None else None
            found = FlagUse(name, tok.value, Tok(tok.value.split("=", 1)[1], raw=raw, literal=tok.literal,
                                                 origin=tok.origin))
        else:
            value = toks[i + 1] if i + 1 < len(toks) and not _is_flag(toks[i + 1]) else None
            found = FlagUse(name, tok.value, value)
    return found


def _served_names(toks: list[Tok]) -> list[str] | None:
    """The values of the last `--served-model-name` (argparse keeps the last); None if unset."""
    names: list[str] | None = None
    for i, tok in enumerate(toks):
        if _flag(tok.value) == SERVED_NAME_FLAG:
            if "=" in tok.value:
                names = [tok.value.split("=", 1)[1]]
            else:
                names = []
                for t in toks[i + 1:]:
                    if _is_flag(t):
                        break
                    names.append(t.value)
    return names


# --- recognising the program ---------------------------------------------------


@dataclass(frozen=True)
class _Match:
    kind: str  # "serve" | "api_server" | "shell"
    at: int  # index of the program's first word
    start: int  # serve/api_server: index of vLLM's first argument; shell: index of the script
    what: str  # for messages


def _match(toks: list[Tok], i: int) -> _Match | None:
    """Whether toks[i:] runs vLLM's server (or a shell); raises for another vLLM command."""
    tok = toks[i]
    if not tok.literal:
        return None
    base = posixpath.basename(tok.value)
    nxt = toks[i + 1].value if i + 1 < len(toks) else None
    if base == "vllm":
        if nxt == "serve":
            return _Match("serve", i, i + 2, "`vllm serve`")
        raise ServingError(f"runs `vllm {nxt or ''}`".rstrip() + ", not `vllm serve`: Ferry wires vLLM's OpenAI "
                           "server (`vllm serve MODEL ...` or `python3 -m vllm.entrypoints.openai.api_server`)")
    if _PYTHON.fullmatch(base):
        return _python_match(toks, i, base)
    if base in SHELLS:
        return _shell_match(toks, i, base)
    return None


def _python_match(toks: list[Tok], i: int, base: str) -> _Match | None:
    """toks[i] is a Python: whether it runs vLLM's server module (`-m`); raises for another vLLM module."""
    j = i + 1
    while j < len(toks) and toks[j].value.startswith("-") and toks[j].value != "-m":
        if toks[j].value == "-c":
            return None  # python -c CODE
        j += 2 if toks[j].value in _PY_OPTS_WITH_VALUE else 1
    if j + 1 >= len(toks) or toks[j].value != "-m":
        return None
    module = toks[j + 1].value
    if module in API_SERVER_MODULES:
        return _Match("api_server", i, j + 2, f"`{base} -m {module}`")
    if module == CLI_MODULE:
        sub = toks[j + 2].value if j + 2 < len(toks) else ""
        if sub == "serve":
            return _Match("serve", i, j + 3, f"`{base} -m {module} serve`")
        raise ServingError(f"runs `{base} -m {module} {sub}`".rstrip() + ", not `serve`: Ferry wires vLLM's "
                           "OpenAI server")
    if module == "vllm" or module.startswith("vllm."):
        raise ServingError(f"runs `{base} -m {module}`, which Ferry does not know as vLLM's server: use "
                           "`vllm serve MODEL ...` or `python3 -m vllm.entrypoints.openai.api_server --model ...`")
    return None


def _shell_match(toks: list[Tok], i: int, base: str) -> _Match | None:
    """toks[i] is a shell: whether it runs a `-c` script, past its options."""
    j, has_c = i + 1, False
    while j < len(toks):
        v = toks[j].value
        if v == "--":
            j += 1
            break
        if v in _SHELL_OPTS_WITH_VALUE:
            j += 2
            continue
        if v.startswith("--"):
            j += 1
            continue
        if re.fullmatch(r"[-+][A-Za-z]+", v):
            has_c = has_c or (v[0] == "-" and "c" in v)
            j += 1
            continue
        break
    if has_c and j < len(toks):
        return _Match("shell", i, j, f"`{base} -c` script")
    return None


def _launcher(toks: list[Tok]) -> _Match | None:
    """The server (or shell) this argv runs, after wrapper words; None if none is recognised."""
    wrapped = False
    for i, tok in enumerate(toks):
        found = _match(toks, i)
        if found is not None:
            return found
        v = tok.value
        if _ASSIGNMENT.match(v):
            continue  # NAME=value (its value may expand: it only sets the environment)
        if not tok.literal:
            return None
        if posixpath.basename(v) in WRAPPERS:
            wrapped = True
        elif not (wrapped and v.startswith("-")):
            return None
    return None


# --- the vLLM invocation ---------------------------------------------------------


@dataclass(frozen=True)
class Recognised:
    """A container shape: what the user's command line says, and how to rewrite it."""

    shape: str  # e.g. "`vllm serve` in command/args"; for messages
    model: str | None  # the model the container names (positional or --model); None: none given
    served_names: list[str] | None  # the --served-model-name values; None: unset
    _wire: Callable[[str, list[str], str | None, bool, bool], tuple[list[str], list[str]]] = field(repr=False)
    args: tuple[Tok, ...] = ()  # the words vLLM parses as its arguments (after `serve` or the module)

    def wire(self, model: str, flags: list[str], served_name: str | None,
             replace_served: bool, replace_group: bool = False) -> tuple[list[str], list[str]]:
        """(command, args) with `model` where vLLM reads it, Ferry's `flags` last, then
        `--served-model-name served_name` (unless None); replace_served drops the
        current --served-model-name first (it is Ferry's own); replace_group drops
        vLLM's multi-node flags (Ferry's for a group, or left from one)."""
        return self._wire(model, flags, served_name, replace_served, replace_group)


def _model_tok(kind: str, rest: list[Tok]) -> tuple[Tok | None, Tok | None]:
    """(positional, the model the user named) among vLLM's arguments."""
    positional = rest[0] if rest and not _is_flag(rest[0]) else None
    if kind == "flags":
        positional = None  # vLLM's flags only; a wrapper's own first arguments are its business
    named = _flag_value(rest, MODEL_FLAG)
    if kind == "serve":
        return positional, positional or named
    return positional, named or positional


def _invocation(kind: str, toks: list[Tok], start: int, shape: str) -> tuple[str | None, list[str] | None,
                                                                            Callable[..., list[Tok]], tuple[Tok, ...]]:
    """(user's model, served names, rewrite, vLLM's arguments) for vLLM arguments toks[start:]."""
    head, rest = toks[:start], toks[start:]
    positional, named = _model_tok(kind, rest)
    if named is not None and not named.literal:
        by = "the shell expands" if named.raw is not None else "Kubernetes expands from the container's env"
        raise ServingError(f"{shape}: the model is `{named.raw or named.value}`, which {by}; Ferry cannot "
                           "replace a model it cannot read: write the model literally (or leave it out: Ferry "
                           "sets it)")

    def rewrite(model: str, flags: list[str], served_name: str | None, replace_served: bool,
                replace_group: bool = False) -> list[Tok]:
        args = rest[1:] if positional is not None else rest
        kept = _strip(args, replace_served, replace_group)
        new = [Tok(v) for v in flags]
        if served_name is not None:
            new += [Tok(SERVED_NAME_FLAG), Tok(served_name)]
        if kind == "serve":
            # The positional takes precedence over --model: Ferry's model goes there.
            origin = rest[0].origin if rest else 1
            return head + [Tok(model, origin=origin)] + kept + new
        return head + kept + [Tok(MODEL_FLAG), Tok(model)] + new

    return (named.value if named is not None else None), _served_names(rest), rewrite, tuple(rest)


def _split(toks: list[Tok]) -> tuple[list[str], list[str]]:
    command = [t.value for t in toks if t.origin == 0]
    args = [t.value for t in toks if t.origin == 1]
    assert [t.origin for t in toks] == sorted(t.origin for t in toks), "command words must precede args"
    return command, args


def _argv_shape(toks: list[Tok], found: _Match) -> Recognised:
    place = "command" if toks[found.at].origin == 0 else "args"
    shape = f"{found.what} in {place}"
    model, served, rewrite, args = _invocation(found.kind, toks, found.start, shape)
    return Recognised(shape, model, served, lambda *a: _split(rewrite(*a)), args)


def recognise(command: list[str], args: list[str]) -> Recognised:
    """The shape of a container's command line; ServingError if Ferry cannot wire it safely."""
    toks = [Tok(v, literal=not _K8S_VAR.search(v), origin=0) for v in command] + \
        [Tok(v, literal=not _K8S_VAR.search(v), origin=1) for v in args]
    found = _launcher(toks)
    if found is not None and found.kind == "shell":
        return _shell_shape(toks, found)
    if found is not None:
        return _argv_shape(toks, found)
    if not command:
        if args and not args[0].startswith("-"):
            shape = "the image's entrypoint (`vllm serve`) with the model as args[0]"
            model, served, rewrite, vllm_args = _invocation("serve", toks, 0, shape)
        else:
            shape = "flags for the image's entrypoint"
            model, served, rewrite, vllm_args = _invocation("flags", toks, 0, shape)
        return Recognised(shape, model, served, lambda *a: _split(rewrite(*a)), vllm_args)
    if args and not args[0].startswith("-"):
        raise ServingError(
            f"runs `{shlex.join(command)}`, which Ferry does not recognise as vLLM, with `{args[0]}` as its first "
            "argument: Ferry cannot tell where the model goes. Run vLLM directly (`command: [vllm, serve]`, "
            "`args: [MODEL, ...]`, or `python3 -m vllm.entrypoints.openai.api_server --model ...`), or give the "
            "wrapper flags only (Ferry sets `--model`)"
        )
    shape = f"flags for `{command[0]}`"
    model, served, rewrite, vllm_args = _invocation("flags", toks, 1, shape)
    return Recognised(shape, model, served, lambda *a: _split(rewrite(*a)), vllm_args)


# --- shell scripts ---------------------------------------------------------------


@dataclass(frozen=True)
class _Word:
    raw: str
    value: str
    literal: bool
    start: int
    end: int


@dataclass(frozen=True)
class _Op:
    text: str
    start: int
    end: int


class _Unreadable(Exception):
    pass


_OPS = ("&&", "||", ";;", "<<-", "<<", ">>", "<&", ">&", "<>", ">|", "|", "&", ";", "<", ">", "(", ")")
_OP_CHARS = frozenset("|&;<>()")


def _skip_balanced(s: str, i: int, close: str) -> int:
    """Index after the `close` matching an opening just before s[i] (quotes skipped)."""
    opening = {")": "(", "}": "{"}[close]
    depth = 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if c == "'":
            j = s.find("'", i + 1)
            if j < 0:
                raise _Unreadable("an unterminated ' quote")
            i = j + 1
            continue
        if c == '"':
            i += 1
            while i < len(s) and s[i] != '"':
                i += 2 if s[i] == "\\" else 1
            if i >= len(s):
                raise _Unreadable('an unterminated " quote')
        elif c == opening:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise _Unreadable(f"an unterminated `{opening}`")


def _skip_expansion(s: str, i: int) -> int:
    """Index after the expansion that starts at s[i] (`$...` or a backquote)."""
    if s[i] == "`":
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == "`":
                return j + 1
            j += 1
        raise _Unreadable("an unterminated ` command substitution")
    if s.startswith("$(", i):
        return _skip_balanced(s, i + 2, ")")
    if s.startswith("${", i):
        return _skip_balanced(s, i + 2, "}")
    j = i + 1
    if j < len(s) and (s[j].isalnum() or s[j] == "_"):
        while j < len(s) and (s[j].isalnum() or s[j] == "_"):
            j += 1
        return j
    if j < len(s) and s[j] in "@*#?$!-":
        return j + 1
    return j


def _lex(s: str) -> list[_Word | _Op]:
    """POSIX shell words and operators, each with its span in `s`."""
    out: list[_Word | _Op] = []
    i, n = 0, len(s)
    while i < n:
        c = s[i]
        if c in " \t":
            i += 1
            continue
        if s.startswith("\\\n", i):
            i += 2
            continue
        if c == "#":
            j = s.find("\n", i)
            i = n if j < 0 else j
            continue
        if c == "\n":
            out.append(_Op("\n", i, i + 1))
            i += 1
            continue
        if c in _OP_CHARS:
            op = next(o for o in _OPS if s.startswith(o, i))
            out.append(_Op(op, i, i + len(op)))
            i += len(op)
            continue
        word = _word(s, i)
        out.append(word)
        i = word.end
    return out


def _word(s: str, i: int) -> _Word:
    """The shell word that starts at s[i]: its text, its value with the quotes removed, and whether it is
    literal (no expansion, glob, brace or tilde)."""
    n = len(s)
    start, value, literal = i, [], True
    while i < n and s[i] not in " \t\n" and s[i] not in _OP_CHARS:
        c = s[i]
        if c == "\\":
            if i + 1 >= n:
                raise _Unreadable("a trailing backslash")
            if s[i + 1] != "\n":
                value.append(s[i + 1])
            i += 2
        elif c == "'":
            j = s.find("'", i + 1)
            if j < 0:
                raise _Unreadable("an unterminated ' quote")
            value.append(s[i + 1:j])
            i = j + 1
        elif c == '"':
            i, expands = _double_quoted(s, i + 1, value)
            literal = literal and not expands
        elif c in "$`":
            literal = False
            i = _expansion(s, i, value)
        else:
            if c in "*?[{~":
                literal = False  # glob, brace or tilde expansion
            value.append(c)
            i += 1
    return _Word(s[start:i], "".join(value), literal, start, i)


def _double_quoted(s: str, i: int, value: list[str]) -> tuple[int, bool]:
    """The inside of a double-quoted string from s[i] (after its opening quote), appended to `value`: the
    index after the closing quote, and whether it holds an expansion."""
    n, expands = len(s), False
    while True:
        if i >= n:
            raise _Unreadable('an unterminated " quote')
        c = s[i]
        if c == '"':
            return i + 1, expands
        if c == "\\" and i + 1 < n and s[i + 1] in '$`"\\\n':
            if s[i + 1] != "\n":
                value.append(s[i + 1])
            i += 2
        elif c in "$`":
            expands = True
            i = _expansion(s, i, value)
        else:
            value.append(c)
            i += 1


def _expansion(s: str, i: int, value: list[str]) -> int:
    """The expansion (`$…`, a backquoted command) at s[i], kept as written in `value`: the index after it."""
    j = _skip_expansion(s, i)
    value.append(s[i:j])
    return j


def _launches(words: list[_Word | _Op], shape: str, fix: str) -> list[tuple]:
    """Each simple command of a script that launches vLLM: (its flat command between `;`, newlines and `&&`,
    its words, its tokens, the launcher found). A compound command is refused."""
    segments: list[list[_Word | _Op]] = [[]]
    for w in words:
        if isinstance(w, _Op) and w.text in _SEPARATORS:
            segments.append([])
        else:
            segments[-1].append(w)
    candidates = []
    for seg in segments:  # a flat command may hold other operators: a pipeline, redirections
        simple: list[list[_Word]] = [[]]
        for w in seg:
            if isinstance(w, _Op):
                simple.append([])
            else:
                simple[-1].append(w)
        for cmd in simple:
            if not cmd:
                continue
            if cmd[0].literal and cmd[0].value in _RESERVED:
                raise ServingError(f"{shape}: the script has a compound command (`{cmd[0].value} ...`), which "
                                   f"Ferry does not rewrite; {fix}")
            ctoks = [Tok(w.value, raw=w.raw, literal=w.literal) for w in cmd]
            try:
                m = _launcher(ctoks)
            except ServingError as exc:
                raise ServingError(f"{shape}: the script {exc}") from None
            if m is not None:
                candidates.append((seg, cmd, ctoks, m))
    return candidates


def _shell_shape(toks: list[Tok], found: _Match) -> Recognised:
    script_tok = toks[found.start]
    place = "command" if script_tok.origin == 0 else "args"
    shape = f"{found.what} in {place}"
    script = script_tok.value
    fix = ("run vLLM directly (`command: [vllm, serve]`, `args: [MODEL, ...]`) or keep the script to plain "
           "commands joined by `;`, `&&` or newlines, with one literal `vllm serve MODEL ...`")
    try:
        words = _lex(script)
    except _Unreadable as exc:
        raise ServingError(f"{shape}: Ferry cannot read the script ({exc}); {fix}") from None
    if any(isinstance(w, _Op) and w.text.startswith("<<") for w in words):
        raise ServingError(f"{shape}: the script has a here-document, which Ferry does not rewrite; {fix}")

    candidates = _launches(words, shape, fix)
    if not candidates:
        raise ServingError(f"{shape}: Ferry finds no literal `vllm serve` or "
                           f"`python3 -m vllm.entrypoints.openai.api_server` command in the script; {fix}")
    if len(candidates) > 1:
        raise ServingError(f"{shape}: the script runs vLLM {len(candidates)} times; Ferry rewrites exactly one; {fix}")
    seg, cmd, ctoks, m = candidates[0]
    if m.kind == "shell":
        raise ServingError(f"{shape}: the script runs another shell script (`{cmd[m.at].raw} ...`); {fix}")
    ops = [w.text for w in seg if isinstance(w, _Op)]
    if ops:
        shown = " ".join(dict.fromkeys(o for o in ops))
        raise ServingError(f"{shape}: the vLLM command is joined to others with `{shown}` (a pipeline, "
                           f"redirection, subshell, `||` or background job), which Ferry does not rewrite; {fix}")
    inner = f"{shape} running {m.what}"
    model, served, rewrite, vllm_args = _invocation(m.kind, ctoks, m.start, inner)

    def wire(*a) -> tuple[list[str], list[str]]:
        text = " ".join(t.raw if t.raw is not None else shlex.quote(t.value) for t in rewrite(*a))
        new_script = script[:cmd[0].start] + text + script[cmd[-1].end:]
        new = [Tok(new_script, origin=t.origin) if t is script_tok else t for t in toks]
        return _split(new)

    return Recognised(inner, model, served, wire, vllm_args)
