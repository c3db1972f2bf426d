"""Which files of a checkpoint to fetch: vLLM's own rules, as a pure function.

Ferry's output is a local directory that vLLM (or a Ferry step) then loads, so
the rules are those vLLM 0.32 applies when it loads a *local* directory with the
default `--load-format auto` (`DefaultModelLoader._prepare_weights` with the
`hf` format, `filter_duplicate_safetensors_files`,
`filter_files_not_needed_for_inference`), after the download-time ignore
patterns (`LoadConfig.ignore_patterns`, default `original/**/*`):

1. Drop files matching an ignore pattern. Patterns are matched like
   huggingface_hub's `filter_repo_objects`: `fnmatch` on the whole path, `*`
   crossing `/`, a trailing `/` meaning "everything below". (So vLLM's default
   `original/**/*` only matches files at least two levels below `original/`;
   `original/consolidated.00.pth` is never fetched anyway, because rule 2 only
   looks at top-level files.)
2. Weight patterns `*.safetensors`, `*.bin`, `*.pt`, tried in that order and
   matched like `glob.glob` in the checkpoint directory: `*` stays within one
   path segment and skips hidden names. The first pattern that matches any
   file decides the weight files; the others are not fetched.
3. If that pattern is a safetensors one and `model.safetensors.index.json` is
   present, keep only the files its `weight_map` names (this removes e.g. a
   `consolidated.safetensors` sitting next to sharded files); a file the index
   names but the source lacks is an error, as in vLLM.
   Otherwise drop training artifacts (`training_args.bin`, `optimizer.bin`,
   `optimizer.pt`, `scheduler.pt`, `scaler.pt`, matched as name suffixes).
4. No weight file left: error.

Explicit allow patterns replace the list in rule 2 (vLLM's
`allow_patterns_overrides`): still first-match-wins, and, as in vLLM 0.32, the
index filter of rule 3 is then not applied.

Besides weights, the files vLLM and tokenizers read from the top level of a
model directory always come along (config, generation config, tokenizer
files, chat templates, quantization configs, the index, remote-code modules):
see METADATA_PATTERNS. `trainer_state.json`, a training artifact, does not.

Deliberate difference: vLLM >= 0.11 with `auto` switches to its "mistral"
format when any `consolidated*.safetensors` exists. Ferry keeps the HF layout
(the index's shards) instead, so the fetched directory holds no consolidated
file and vLLM's `auto` then loads exactly what Ferry fetched; a repository with
*only* consolidated files keeps them (rule 3 has no index to apply), and vLLM
loads them as "mistral".
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Generic, Iterable, Mapping, Protocol, Sequence, TypeVar

from ..paths import safe_relative_path

WEIGHT_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin", "*.pt")
DEFAULT_IGNORE_PATTERNS: tuple[str, ...] = ("original/**/*",)
SAFETENSORS_INDEX = "model.safetensors.index.json"
TRAINING_ARTIFACTS: tuple[str, ...] = (
    "training_args.bin",
    "optimizer.bin",
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
)
METADATA_PATTERNS: tuple[str, ...] = (
    "*.json",  # config, generation_config, tokenizer*, index, params.json, quantization configs
    "*.model",  # sentencepiece tokenizer.model
    "tokenizer.model.v*",  # mistral_common tokenizers
    "*.tiktoken",
    "*.txt",  # merges.txt, vocab.txt
    "*.jinja",  # chat templates
    "*.py",  # trust_remote_code modules (fetched, never executed by Ferry)
)
METADATA_EXCLUDED: frozenset[str] = frozenset({"trainer_state.json"})


class NoWeightsError(Exception):
    """The source holds no weight file the rules select."""


class BadIndexError(Exception):
    """`model.safetensors.index.json` is malformed or names files the source lacks."""


class Listed(Protocol):
    @property
    def path(self) -> str: ...


F = TypeVar("F", bound=Listed)


@dataclass(frozen=True)
class Selection(Generic[F]):
    weights: tuple[F, ...]
    metadata: tuple[F, ...]
    pattern: str  # the weight pattern that won
    safetensors: bool

    @property
    def files(self) -> tuple[F, ...]:
        return self.metadata + self.weights


def hub_pattern_match(path: str, pattern: str) -> bool:
    """huggingface_hub's `filter_repo_objects` semantics (used for ignore patterns)."""
    if pattern.endswith("/"):
        pattern += "*"
    return fnmatchcase(path, pattern)


def glob_match(path: str, pattern: str) -> bool:
    """`glob.glob(os.path.join(folder, pattern))` semantics for a relative file path.

    Segment by segment; a wildcard never crosses `/`; a hidden name (leading
    dot) only matches a pattern segment that starts with a dot. Without
    `recursive=True`, glob treats `**` like `*`, and so does this.
    """
    names, parts = path.split("/"), pattern.split("/")
    if len(names) != len(parts):
        return False
    for name, part in zip(names, parts):
        if name.startswith(".") and not part.startswith("."):
            return False
        if not fnmatchcase(name, part):
            return False
    return True


def parse_index(data: bytes, *, origin: str) -> Mapping[str, str]:
    """The `weight_map` of a safetensors index: tensor name -> file name."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadIndexError(f"{origin}: not valid JSON: {e}") from None
    weight_map = body.get("weight_map") if isinstance(body, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise BadIndexError(f"{origin}: no 'weight_map' object of tensor name -> file name")
    for file_name in set(weight_map.values()):
        safe_relative_path(file_name, origin=origin)
    return weight_map


def needs_index(files: Iterable[Listed], ignore_patterns: Sequence[str] = ()) -> bool:
    """Whether `select` will want the index's weight map for this listing."""
    ignore = (*DEFAULT_IGNORE_PATTERNS, *ignore_patterns)
    return any(f.path == SAFETENSORS_INDEX and not _ignored(f.path, ignore) for f in files)


def _first_match(candidates: Sequence[F], patterns: Sequence[str]) -> tuple[list[F], str]:
    """The files the first weight pattern that matches any selects, and that pattern ("" if none does)."""
    for pattern in patterns:
        weights = [f for f in candidates if glob_match(f.path, pattern)]
        if weights:
            return weights, pattern
    return [], ""


def select(
    files: Sequence[F],
    *,
    weight_map: Mapping[str, str] | None = None,
    allow_patterns: Sequence[str] = (),
    ignore_patterns: Sequence[str] = (),
    source: str = "source",
) -> Selection[F]:
    """Apply the rules above to a listing. `weight_map` is the parsed index, if the listing has one."""
    ignore = (*DEFAULT_IGNORE_PATTERNS, *ignore_patterns)
    candidates = [f for f in files if not _ignored(f.path, ignore)]
    patterns = tuple(allow_patterns) or WEIGHT_PATTERNS

    weights, chosen = _first_match(candidates, patterns)
    use_safetensors = chosen.endswith(".safetensors")

    if use_safetensors:
        has_index = any(f.path == SAFETENSORS_INDEX for f in candidates)
        if not allow_patterns and has_index:
            if weight_map is None:
                raise ValueError(f"select() needs the weight map of {SAFETENSORS_INDEX} for this listing")
            weights = _filter_by_index(weights, weight_map, source)
    else:
        weights = [f for f in weights if not f.path.endswith(TRAINING_ARTIFACTS)]

    if not weights:
        raise NoWeightsError(
            f"{source}: no model weights found (weight patterns tried in order: {', '.join(patterns)}; "
            f"ignored: {', '.join(ignore)}; training artifacts {', '.join(TRAINING_ARTIFACTS)} never count)"
        )

    weight_paths = {f.path for f in weights}
    metadata = [
        f
        for f in candidates
        if f.path not in weight_paths
        and f.path not in METADATA_EXCLUDED
        and any(glob_match(f.path, p) for p in METADATA_PATTERNS)
    ]
    return Selection(
        weights=tuple(sorted(weights, key=lambda f: f.path)),
        metadata=tuple(sorted(metadata, key=lambda f: f.path)),
        pattern=chosen,
        safetensors=use_safetensors,
    )


def _ignored(path: str, patterns: Sequence[str]) -> bool:
    return any(hub_pattern_match(path, p) for p in patterns)


def _filter_by_index(weights: list[F], weight_map: Mapping[str, str], source: str) -> list[F]:
    indexed = set(weight_map.values())
    missing = indexed - {f.path for f in weights}
    if missing:
        raise BadIndexError(
            f"{source}: {SAFETENSORS_INDEX} references weight files the source lacks: {', '.join(sorted(missing))}"
        )
    return [f for f in weights if f.path in indexed]
