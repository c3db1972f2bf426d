"""The committed CRD is exactly what the API types generate, and it is a
structural schema kubectl explain can teach from."""
from __future__ import annotations

from pathlib import Path

import yaml

from ferry_operator.api.crd import crd, crd_yaml

REPO = Path(__file__).resolve().parent.parent
COMMITTED = [REPO / "crds/ferry.dev_modelweights.yaml", REPO / "charts/ferry/crds/ferry.dev_modelweights.yaml"]


def test_committed_crds_match_the_types():
    generated = crd_yaml()
    for path in COMMITTED:
        assert path.read_text() == generated, f"{path.relative_to(REPO)} is stale: run `make crds`"


def _walk(schema, path="openAPIV3Schema"):
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")


def test_schema_is_structural_and_documented():
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "type" in node, f"{path} has no type"
        assert not {"$ref", "anyOf", "allOf", "oneOf", "title"} & node.keys(), f"{path} is not structural"
        if not path.startswith(("openAPIV3Schema.spec", "openAPIV3Schema.status")):
            continue
        assert node.get("description"), f"{path} has no description (kubectl explain shows it)"
        if node.get("type") == "string" and "enum" not in node and "format" not in node:
            # CEL cost estimation rejects rules over unbounded strings.
            assert "maxLength" in node, f"{path} string without maxLength"


def test_crd_yaml_round_trips():
    assert yaml.safe_load(crd_yaml()) == crd()
