"""A strategic-merge patch of a pod template applied here, as the API server
applies it to a Deployment's. Pure.

Why: a LeaderWorkerSet is a custom resource, and the API server merges
custom resources only as JSON merge patches (lists replaced whole). Ferry
computes one patch per pod template (serving.template_patch) for every kind;
for a LeaderWorkerSet it applies that patch to the template it read and sends
the merged template. Only the patch vocabulary of Ferry's wiring is needed,
and only that is implemented (anything else is refused, never guessed):
maps merge (null deletes a key; `$retainKeys` drops the keys it does not
list), the lists below merge by their key (an element
`{"<key>": ..., "$patch": "delete"}` deletes), and every other list is
replaced. tests/test_serving_patch_apiserver.py checks the result against
the real API server's merge of the same patches.
"""
from __future__ import annotations

import copy
from typing import Any

# Lists Kubernetes merges by a key (core/v1 patchStrategy=merge) that Ferry's patches touch.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
}
DIRECTIVE = "$patch"
RETAIN_KEYS = "$retainKeys"


class UnsupportedPatch(ValueError):
    """A patch outside the vocabulary this module implements."""


def apply(target: Any, patch: Any) -> Any:
    """`target` with the strategic-merge `patch` applied (a new object; neither input changes)."""
    return _merge(copy.deepcopy(target), patch, key=None)


def _merge(target: Any, patch: Any, key: str | None) -> Any:
    if isinstance(patch, dict):
        unknown = [k for k in patch if k.startswith("$") and k != RETAIN_KEYS]
        if unknown:
            raise UnsupportedPatch(f"directive {unknown[0]!r} on a map at {key!r}")
        out = dict(target) if isinstance(target, dict) else {}
        for k, v in patch.items():
            if k == RETAIN_KEYS:
                continue
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _merge(out.get(k), v, k)
        if RETAIN_KEYS in patch:  # the map keeps only these keys (a volume's source swapped for another)
            out = {k: v for k, v in out.items() if k in patch[RETAIN_KEYS]}
        return out
    if isinstance(patch, list) and key in MERGE_KEYS:
        return _merge_list(list(target or []), patch, MERGE_KEYS[key])
    return copy.deepcopy(patch)


def _merge_list(target: list[dict], patch: list[dict], merge_key: str) -> list[dict]:
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise UnsupportedPatch(f"list element without its merge key {merge_key!r}: {item!r}")
        at = next((i for i, t in enumerate(target) if t.get(merge_key) == item[merge_key]), None)
        directive = item.get(DIRECTIVE)
        if directive == "delete":  # every element of that key, as the API server deletes them
            target[:] = [t for t in target if t.get(merge_key) != item[merge_key]]
            continue
        if directive is not None:
            raise UnsupportedPatch(f"directive {directive!r} in a list merged by {merge_key!r}")
        if at is None:
            target.append(_merge({}, item, None))
        else:
            target[at] = _merge(target[at], item, None)
    return target
