"""The API types offline: valid manifests parse, every invalid one is refused
with an error naming the field (the same table the admission tests use)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ferry_operator.api import types
from ferry_operator.api.validation import InvalidSpec, parse
from spec_cases import INVALID, VALID, manifest


@pytest.mark.parametrize("name", list(VALID))
def test_valid_manifests_parse(name):
    parse(VALID[name])


@pytest.mark.parametrize("case_id,obj,field,words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_manifests_name_the_field(case_id, obj, field, words):
    with pytest.raises(InvalidSpec) as exc:
        parse(obj)
    matching = [e for e in exc.value.errors if e.startswith(field + ":")]
    assert matching, f"no error on {field}: {exc.value.errors}"
    assert any(words in e for e in matching), f"{words!r} not in {matching}"


def test_defaults_fill_in():
    mw = parse({"apiVersion": "ferry.dev/v1alpha1", "kind": "ModelWeights", "metadata": {"name": "x"},
                "spec": {"source": {"uri": "hf://a/b"}, "storage": {"pvc": {"size": "1Gi"}}}})
    assert mw.spec.format.type == "safetensors"
    assert mw.spec.format.tensor_parallel_size == 1
    assert mw.spec.format.max_part_size == "5Gi"
    fmt = mw.spec.format
    assert (fmt.expert_parallel, fmt.expert_placement, fmt.target) == (False, "linear", "hopper")
    assert mw.spec.deletion_policy == "Retain"
    assert mw.spec.storage.pvc.access_modes == ["ReadWriteOnce"]


def test_round_trip_keeps_camel_case():
    mw = parse(manifest())
    dumped = mw.model_dump(by_alias=True, exclude_none=True, mode="json")
    assert dumped["spec"]["format"]["tensorParallelSize"] == 4
    assert parse(dumped) == mw


def test_every_condition_type_fits_the_schema():
    from datetime import datetime, timezone

    for ct in types.ConditionType:
        types.Condition(type=ct.value, status="True", reason="Test", message="",
                        last_transition_time=datetime.now(timezone.utc))


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "e2e/examples").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_examples_are_valid(path):
    for doc in yaml.safe_load_all(path.read_text()):
        parse(doc)
