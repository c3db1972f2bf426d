"""Parse a ModelWeights object and report errors the way the API server does."""
from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .rules import RULE_ERROR
from .types import ModelWeights


class InvalidSpec(ValueError):
    """A ModelWeights that breaks the API's rules; `errors` are 'field.path: message'."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def format_errors(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        path = _path(err["loc"])
        msg = err["msg"]
        if err["type"] == RULE_ERROR:
            path += err["ctx"]["field_path"]
        elif err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif not isinstance(err.get("input"), (dict, list)) and "input" in err:
            msg += f" (got {err['input']!r})"
        lines.append(f"{path}: {msg}")
    return lines


def parse(obj: dict[str, Any]) -> ModelWeights:
    """Validate a ModelWeights object (a dict, as read from YAML or the API)."""
    try:
        return ModelWeights.model_validate(obj)
    except ValidationError as exc:
        raise InvalidSpec(format_errors(exc)) from None
