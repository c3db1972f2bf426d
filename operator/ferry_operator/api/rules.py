"""Validation rules declared once, enforced twice.

A `Rule` carries a CEL expression for the API server (emitted into the CRD as
`x-kubernetes-validations`, so bad specs are rejected at admission) and the
equivalent Python predicate, so the same spec parsed by the operator or the CLI
fails with the same message. The invalid-spec test table runs every case
against both, which keeps the two halves from drifting.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from pydantic_core import PydanticCustomError


@dataclass(frozen=True)
class Rule:
    cel: str
    message: str
    check: Callable[[Any], bool]
    # Relative JSONPath of the field the error is reported on (CRD `fieldPath`),
    # e.g. ".storage.s3"; None reports on the object the rule is attached to.
    field_path: str | None = None

    def to_crd(self) -> dict[str, str]:
        out = {"rule": self.cel, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        return out


def matches(pattern: str, message: str, *, unless_prefix: str | None = None) -> Rule:
    """A regex rule on a string field; optionally only for values with a prefix.

    The pattern must use the common subset of RE2 (CEL) and Python `re`.
    """
    compiled = re.compile(pattern)
    if unless_prefix is None:
        return Rule(f"self.matches('{pattern}')", message, lambda v: bool(compiled.search(v)))
    return Rule(
        f"!self.startsWith('{unless_prefix}') || self.matches('{pattern}')",
        message,
        lambda v: not v.startswith(unless_prefix) or bool(compiled.search(v)),
    )


def crd_validations(rules: list[Rule]) -> dict[str, list[dict[str, str]]]:
    """json_schema_extra fragment for a field or model."""
    return {"x-kubernetes-validations": [r.to_crd() for r in rules]}


RULE_ERROR = "ferry_rule"


def enforce(rules: list[Rule], value: Any) -> Any:
    """Raise a validation error for the first rule `value` breaks; return it otherwise.

    The error carries the rule's field_path, so `errors.format_errors` can name
    the deeper field the way the API server does.
    """
    for rule in rules:
        if not rule.check(value):
            raise rule_error(rule.message, rule.field_path or "")
    return value


def rule_error(message: str, field_path: str = "") -> PydanticCustomError:
    return PydanticCustomError(RULE_ERROR, "{message}", {"message": message, "field_path": field_path})
