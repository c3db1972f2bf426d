"""Generate the ModelWeights CustomResourceDefinition from the pydantic types.

Pydantic's JSON Schema is close to a Kubernetes structural schema; this module
closes the gap: `$ref`s are inlined, `Optional[X]` (anyOf X|null) becomes X,
titles and null defaults are dropped, and only the keywords the API server
accepts are kept.
"""
from __future__ import annotations

from typing import Any

import yaml

from . import types

# Keywords a structural schema may carry (apiextensions.k8s.io/v1 JSONSchemaProps).
_KEEP = {
    "type", "description", "properties", "required", "items", "enum", "default",
    "pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "minItems", "maxItems", "format", "nullable",
    "additionalProperties",
    "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
    "x-kubernetes-int-or-string", "x-kubernetes-preserve-unknown-fields",
}
_FORMATS = {"date-time", "int64", "int32", "byte", "date", "duration"}

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
    {"name": "Format", "type": "string", "jsonPath": ".spec.format.type"},
    {"name": "TP", "type": "integer", "jsonPath": ".spec.format.tensorParallelSize"},
    {"name": "Size", "type": "string", "jsonPath": ".status.artifact.size"},
    {"name": "Loaded", "type": "string", "jsonPath": ".status.loaded.summary",
     "description": "Serving pods that verified and loaded the current artifact"},
    {"name": "Cached", "type": "string", "jsonPath": ".status.cache.summary", "priority": 0,
     "description": "Nodes holding the artifact in their node cache (and fills under way)"},
    {"name": "Progress", "type": "integer", "jsonPath": ".status.progress.percent", "description": "Percent of the running step"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        # The referring field's own keywords (description, default) win.
        node = {**target, **node}
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**_resolve(node.pop("allOf")[0], defs), **node}
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unions other than Optional[X] are not structural: {options}")
        node = {**_resolve(options[0], defs), **node}
    if node.get("default", 0) is None:
        del node["default"]
    if "format" in node and node["format"] not in _FORMATS:
        del node["format"]
    # extra="forbid" becomes additionalProperties: false, which a structural
    # schema may not combine with properties; the API server rejects unknown
    # fields anyway (strict field validation) and prunes them otherwise.
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP:
            continue
        if key == "properties":
            out[key] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        return {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _schema_of(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def openapi_schema() -> dict[str, Any]:
    spec = _schema_of(types.ModelWeightsSpec)
    status = _schema_of(types.ModelWeightsStatus)
    return {
        "type": "object",
        "description": types.ModelWeights.__doc__,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "APIVersion of this object."},
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{types.PLURAL}.{types.GROUP}"},
        "spec": {
            "group": types.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": types.KIND,
                "listKind": f"{types.KIND}List",
                "plural": types.PLURAL,
                "singular": types.SINGULAR,
                "shortNames": types.SHORT_NAMES,
                "categories": ["ferry"],
            },
            "versions": [
                {
                    "name": types.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


HEADER = "# Generated from operator/ferry_operator/api/types.py by `make crds`. Do not edit.\n"


class _NoAliasDumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    return HEADER + yaml.dump(crd(), Dumper=_NoAliasDumper, sort_keys=False, width=120)
