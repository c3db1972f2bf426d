"""A Hugging Face checkpoint directory as the sharder sees it: config.json, where
every tensor's bytes live, and the small files that travel with the weights."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..manifest import MANIFEST_NAME
from .model import ShardError
from .plan import TensorSpec
from .tensors import TensorLocation, locate_tensors

CONFIG_NAME = "config.json"
# vLLM's default loader reads only the files this index names when it exists
# (weight_utils.filter_duplicate_safetensors_files): a directory may hold a
# consolidated copy beside the shards.
INDEX_NAME = "model.safetensors.index.json"
# Weight files in other containers. They are not read (a .bin is a pickle) and
# not copied (the artifact holds the weights).
OTHER_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


@dataclass(frozen=True)
class Checkpoint:
    directory: Path
    config: dict
    tensors: dict[str, TensorLocation]
    weight_files: tuple[Path, ...]

    @property
    def specs(self) -> dict[str, TensorSpec]:
        return {name: TensorSpec(loc.dtype, loc.shape, loc.path.name) for name, loc in self.tensors.items()}

    @property
    def weight_bytes(self) -> int:
        return sum(path.stat().st_size for path in self.weight_files)


def open_checkpoint(directory: Path) -> Checkpoint:
    """Read config.json and the safetensors headers (never tensor data)."""
    if not directory.is_dir():
        raise ShardError(f"{directory}: not a directory")
    config = _read_json(directory / CONFIG_NAME)
    files = _weight_files(directory)
    tensors: dict[str, TensorLocation] = {}
    for path in files:
        for loc in locate_tensors(path):
            if loc.name in tensors:
                raise ShardError(f"tensor {loc.name} is stored twice: in {tensors[loc.name].path.name} "
                                 f"and {path.name}")
            tensors[loc.name] = loc
    return Checkpoint(directory, config, tensors, tuple(files))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(f"{path}: missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ShardError(f"{path}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ShardError(f"{path}: not a JSON object")
    return value


def _weight_files(directory: Path) -> list[Path]:
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ShardError(f"{index}: no weight_map object")
        names = sorted({str(name) for name in weight_map.values()})
        outside = [name for name in names if not name or "/" in name or name in (".", "..") or "\0" in name]
        if outside:
            raise ShardError(f"{index}: weight_map names file(s) outside the checkpoint's directory "
                             f"({', '.join(repr(n) for n in outside[:5])}); list the weight files by their names")
        files = [directory / name for name in names]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ShardError(f"{index} names file(s) that are missing: {', '.join(absent)}")
        return files
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        others = sorted(p.name for p in directory.iterdir() if p.name.endswith(OTHER_WEIGHT_SUFFIXES))
        hint = f" (found {', '.join(others)}: ferry never unpickles weights)" if others else ""
        raise ShardError(f"{directory}: no *.safetensors weights{hint}")
    return files


def companion_files(directory: Path) -> list[Path]:
    """Top-level files that serve alongside the weights (config, generation
    config, tokenizer, chat template, ...): everything but weights, the weight
    index, which would describe files the artifact does not have, and the
    source's own manifest (a fetched checkpoint has one; the artifact gets its own)."""
    return sorted(
        p for p in directory.iterdir()
        if p.is_file() and not p.name.startswith(".")
        and p.name not in (INDEX_NAME, MANIFEST_NAME)
        and not p.name.endswith((".safetensors", *OTHER_WEIGHT_SUFFIXES))
    )
