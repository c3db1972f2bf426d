"""vLLM's file selection rules (fetch/selection.py) over listings of real Hub repositories."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

from ferry_worker.fetch.selection import (
    BadIndexError,
    NoWeightsError,
    glob_match,
    hub_pattern_match,
    needs_index,
    parse_index,
    select,
)
from ferry_worker.paths import UnsafePathError


@dataclass(frozen=True)
class F:
    path: str
    size: int = 1


def listing(*paths: str) -> list[F]:
    return [F(p) for p in paths]


def index(*shards: str) -> dict[str, str]:
    return {f"tensor.{i}": shard for i, shard in enumerate(shards)}


def paths(files) -> list[str]:
    return [f.path for f in files]


COMMON = ("config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
          "tokenizer_config.json", "README.md", ".gitattributes")

LLAMA3_8B_INSTRUCT = listing(
    *COMMON, "LICENSE", "USE_POLICY.md",
    "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors", "model.safetensors.index.json",
    "original/consolidated.00.pth", "original/params.json", "original/tokenizer.model",
)
LLAMA3_SHARDS = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]

MISTRAL_7B_V01 = listing(
    *COMMON, "tokenizer.model",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
    "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "pytorch_model.bin.index.json",
)

MISTRAL_7B_INSTRUCT_V03 = listing(
    *COMMON, "consolidated.safetensors", "params.json", "tokenizer.model", "tokenizer.model.v3",
    "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
    "model.safetensors.index.json",
)
MISTRAL_V03_SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]


def test_llama3_takes_the_index_shards_and_leaves_original_and_docs() -> None:
    selection = select(LLAMA3_8B_INSTRUCT, weight_map=index(*LLAMA3_SHARDS))
    assert paths(selection.weights) == LLAMA3_SHARDS
    assert paths(selection.metadata) == [
        "config.json", "generation_config.json", "model.safetensors.index.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ]
    assert selection.safetensors and selection.pattern == "*.safetensors"
    assert not any(p.startswith("original/") for p in paths(selection.files))


def test_safetensors_are_preferred_over_bin() -> None:
    selection = select(MISTRAL_7B_V01, weight_map=index("model-00001-of-00002.safetensors",
                                                        "model-00002-of-00002.safetensors"))
    assert paths(selection.weights) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not any(p.endswith(".bin") for p in paths(selection.files))
    assert "tokenizer.model" in paths(selection.metadata)


def test_consolidated_duplicate_is_dropped_by_the_index() -> None:
    selection = select(MISTRAL_7B_INSTRUCT_V03, weight_map=index(*MISTRAL_V03_SHARDS))
    assert paths(selection.weights) == MISTRAL_V03_SHARDS
    assert "consolidated.safetensors" not in paths(selection.files)
    assert {"params.json", "tokenizer.model", "tokenizer.model.v3"} <= set(paths(selection.metadata))


def test_repository_with_only_consolidated_files_keeps_them() -> None:
    files = listing("params.json", "tekken.json", "consolidated-00001-of-00002.safetensors",
                    "consolidated-00002-of-00002.safetensors", "consolidated.safetensors.index.json")
    selection = select(files)
    assert paths(selection.weights) == ["consolidated-00001-of-00002.safetensors",
                                        "consolidated-00002-of-00002.safetensors"]
    assert "tekken.json" in paths(selection.metadata)


def test_single_file_model_with_bpe_tokenizer() -> None:  # Qwen2.5-0.5B-Instruct
    files = listing(*COMMON, "LICENSE", "merges.txt", "vocab.json", "model.safetensors")
    selection = select(files)
    assert paths(selection.weights) == ["model.safetensors"]
    assert {"merges.txt", "vocab.json"} <= set(paths(selection.metadata))


def test_bin_checkpoint_ignores_other_frameworks() -> None:  # facebook/opt-125m
    files = listing(*COMMON, "pytorch_model.bin", "flax_model.msgpack", "tf_model.h5", "merges.txt", "vocab.json")
    selection = select(files)
    assert paths(selection.weights) == ["pytorch_model.bin"]
    assert not selection.safetensors and selection.pattern == "*.bin"
    assert not {"flax_model.msgpack", "tf_model.h5"} & set(paths(selection.files))


def test_training_artifacts_are_dropped() -> None:
    files = listing(*COMMON, "pytorch_model.bin", "training_args.bin", "optimizer.pt", "scheduler.pt",
                    "scaler.pt", "optimizer.bin", "rng_state.pth", "trainer_state.json")
    selection = select(files)
    assert paths(selection.weights) == ["pytorch_model.bin"]
    assert "trainer_state.json" not in paths(selection.files)
    assert not any(p.endswith((".pt", ".pth")) for p in paths(selection.files))


def test_pt_is_the_last_resort() -> None:
    selection = select(listing("config.json", "model.pt", "optimizer.pt"))
    assert paths(selection.weights) == ["model.pt"] and selection.pattern == "*.pt"


def test_only_training_artifacts_is_no_weights_like_vllm() -> None:
    # "*.bin" matches training_args.bin, so it wins, and the artifact filter empties it: vLLM fails the same way.
    with pytest.raises(NoWeightsError) as err:
        select(listing("config.json", "training_args.bin", "model.pt"), source="s3://b/run-7")
    message = str(err.value)
    assert "s3://b/run-7" in message and "*.safetensors, *.bin, *.pt" in message


def test_no_weights_names_source_and_patterns() -> None:
    with pytest.raises(NoWeightsError, match=r"hf://org/gguf-only: no model weights.*\*\.safetensors"):
        select(listing("config.json", "model-q4.gguf"), source="hf://org/gguf-only")


def test_weights_below_the_top_level_are_not_vllm_weights() -> None:
    with pytest.raises(NoWeightsError):
        select(listing("config.json", "checkpoints/model.safetensors", ".hidden.safetensors"))


def test_allow_patterns_replace_the_weight_patterns_first_match_wins() -> None:
    bins = select(MISTRAL_7B_V01, allow_patterns=["*.gguf", "*.bin"])
    assert paths(bins.weights) == ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    sub = select(listing("config.json", "checkpoints/model.safetensors"), allow_patterns=["checkpoints/*.safetensors"])
    assert paths(sub.weights) == ["checkpoints/model.safetensors"]


def test_explicit_safetensors_pattern_skips_the_index_filter_as_in_vllm_032() -> None:
    selection = select(MISTRAL_7B_INSTRUCT_V03, allow_patterns=["*.safetensors"])
    assert paths(selection.weights) == ["consolidated.safetensors", *MISTRAL_V03_SHARDS]


def test_ignore_patterns_apply_to_weights_and_metadata() -> None:
    selection = select(LLAMA3_8B_INSTRUCT, weight_map=index(*LLAMA3_SHARDS),
                       ignore_patterns=["tokenizer.json", "generation_*"])
    assert not {"tokenizer.json", "generation_config.json"} & set(paths(selection.files))


def test_default_ignore_is_vllms_original_glob() -> None:
    # vLLM's default "original/**/*" (fnmatch) only matches two levels down; a trailing "/" means everything below.
    files = listing("config.json", "original/consolidated.00.pth", "original/sub/x.pth")
    assert paths(select(files, allow_patterns=["original/*.pth"]).weights) == ["original/consolidated.00.pth"]
    with pytest.raises(NoWeightsError):
        select(files, allow_patterns=["original/*.pth"], ignore_patterns=["original/"])


def test_index_naming_a_missing_shard_is_an_error() -> None:
    with pytest.raises(BadIndexError, match="model-00004-of-00004.safetensors"):
        select([f for f in LLAMA3_8B_INSTRUCT if f.path != "model-00004-of-00004.safetensors"],
               weight_map=index(*LLAMA3_SHARDS))


def test_select_insists_on_the_weight_map_when_the_listing_has_an_index() -> None:
    assert needs_index(LLAMA3_8B_INSTRUCT)
    assert not needs_index(LLAMA3_8B_INSTRUCT, ignore_patterns=["*.index.json"])
    with pytest.raises(ValueError, match="weight map"):
        select(LLAMA3_8B_INSTRUCT)


def test_parse_index_refuses_malformed_and_escaping_entries() -> None:
    ok = json.dumps({"metadata": {}, "weight_map": {"a": "model.safetensors"}}).encode()
    assert parse_index(ok, origin="i") == {"a": "model.safetensors"}
    with pytest.raises(BadIndexError, match="not valid JSON"):
        parse_index(b"{", origin="i")
    with pytest.raises(BadIndexError, match="weight_map"):
        parse_index(b'{"metadata": {}}', origin="i")
    with pytest.raises(UnsafePathError, match=r"\.\./"):
        parse_index(json.dumps({"weight_map": {"a": "../../etc/passwd"}}).encode(), origin="i")


GLOB_PATHS = ["model.safetensors", ".hidden.safetensors", "a.bin", "sub/model.safetensors",
              "sub/deeper/x.safetensors", "sub/.h.safetensors", "model-00001-of-00002.safetensors", "x.pt"]
GLOB_PATTERNS = ["*.safetensors", "*.bin", "*.pt", "sub/*.safetensors", "*/*.safetensors", "**/*.safetensors",
                 "model-0000[0-9]-of-*.safetensors", ".*.safetensors", "sub/.*", "*"]


@pytest.mark.parametrize("pattern", GLOB_PATTERNS)
def test_glob_match_is_glob_glob(tmp_path: Path, pattern: str) -> None:
    for rel in GLOB_PATHS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    files = {os.path.relpath(p, tmp_path) for p in glob.glob(os.path.join(tmp_path, pattern)) if os.path.isfile(p)}
    assert {p for p in GLOB_PATHS if glob_match(p, pattern)} == files


@pytest.mark.parametrize("pattern", ["original/**/*", "original/", "*.json", "*/*.pth", "tokenizer*"])
def test_hub_pattern_match_is_huggingface_hub(pattern: str) -> None:
    names = ["original/params.json", "original/a/b.pth", "config.json", "sub/tokenizer.json", "tokenizer.model"]
    assert [n for n in names if hub_pattern_match(n, pattern)] == list(filter_repo_objects(names, ignore_patterns=None,
                                                                                          allow_patterns=[pattern]))
