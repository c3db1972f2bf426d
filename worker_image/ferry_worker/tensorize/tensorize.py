"""`ferry tensorize`: a safetensors checkpoint as tensorizer files, in a store.

    job = TensorizeJob.prepare(source, "s3://bucket/prefix", layout="vllm", tp=2)  # checks; writes nothing
    published = job.run(progress)    # tensor files, companions, manifest last

`prepare` refuses what the checkpoint's config and headers can tell (layout,
release, architecture, TP, dtypes, key file). `run` reuses a complete artifact
of the same request, else records what it will write, streams each tensor
file through tensorizer into the store, uploads config/tokenizer files, and
publishes the manifest only once every object is stored and checked.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import __version__
from ..manifest import MANIFEST_NAME, Manifest, manifest_digest
from ..progress import Progress
from ..results import RESULT_FACTS
from ..shard.source import Checkpoint, companion_files, open_checkpoint
from . import artifact
from .errors import ArtifactError, require_tensorizer
from ..shard.experts import MoeTarget
from .layouts import TensorFile, hf_files, refuse_quantized, vllm_files, vllm_plan
from .location import LocalLocation, Location, parse_location
from .s3_client import S3Options
from .store import StoredObject, open_store
from .versions import check_target, uri_template

log = logging.getLogger(__name__)

FORMAT = "tensorizer"


@dataclass
class TensorizeJob:
    checkpoint: Checkpoint
    location: Location
    layout: str
    tp: int
    vllm_version: str
    files: list[TensorFile]
    companions: list[Path]
    key_file: Path | None = None
    s3: S3Options = field(default_factory=S3Options)
    part_size: int | None = None
    # How a MoE model's experts were cut (`shard.job.moe_extra`); empty for dense models and the hf layout.
    moe_facts: dict = field(default_factory=dict)

    @classmethod
    def prepare(cls, source: Path, output: str, *, layout: str = "hf", tp: int = 1, vllm_version: str = "0.32.0",
                key_file: Path | None = None, s3: S3Options | None = None,
                part_size: int | None = None, moe: MoeTarget = MoeTarget()) -> "TensorizeJob":
        require_tensorizer()
        location = parse_location(output)
        source = Path(source).resolve()
        if isinstance(location, LocalLocation) and location.path == source:
            raise ArtifactError("the output directory must differ from the checkpoint directory")
        vllm = check_target(layout, tp, vllm_version)
        checkpoint = open_checkpoint(source)
        refuse_quantized(checkpoint.config)
        if layout == "hf":
            if moe != MoeTarget():
                raise ArtifactError("expert parallelism and --target shape the vllm layout only; the hf layout is "
                                    "cut by vLLM itself at load time")
            files, moe_facts = hf_files(checkpoint), {}
        else:
            plan = vllm_plan(checkpoint, tp, vllm, moe)
            files, moe_facts = vllm_files(checkpoint, plan), plan.moe_facts()
        if key_file is not None:
            from .encryption import load_key

            load_key(key_file)  # refuse a bad key file before anything is written
        return cls(checkpoint, location, layout, tp, str(vllm), files, companion_files(source), key_file,
                   s3 or S3Options(), part_size, moe_facts)

    @property
    def total_bytes(self) -> int:
        """What the progress counts: tensor data serialized, read back (S3), companions uploaded."""
        read_back = 0 if isinstance(self.location, LocalLocation) else sum(f.size_hint for f in self.files)
        return (sum(f.data_bytes for f in self.files) + read_back
                + sum(p.stat().st_size for p in self.companions))

    def request(self) -> dict[str, Any]:
        """What makes this artifact what it is; a rerun with the same request reuses a complete one."""
        encryption = None
        if self.key_file is not None:
            from .encryption import fingerprint

            encryption = {"keyFingerprint": fingerprint(Path(self.key_file).read_bytes())}
        return {
            "format": FORMAT,
            "layout": self.layout,
            "tensorParallelSize": self.tp,
            "vllmVersion": self.vllm_version,
            "encryption": encryption,
            "source": _source_identity(self.checkpoint),
            "companions": sorted(p.name for p in self.companions),
            **self.moe_facts,
        }

    def run(self, progress: Progress | None = None) -> artifact.Published:
        from .serialize import TensorReader, write_tensor_file

        store = open_store(self.location, self.s3, self.part_size)
        request = self.request()
        reused = artifact.reuse(store, request)
        if reused is not None:
            return self._with_facts(reused, store)
        on_bytes = progress.advance if progress else None
        artifact.begin(store, [f.name for f in self.files] + [p.name for p in self.companions])
        encryption = None
        if self.key_file is not None:
            from .encryption import load_key

            encryption, _ = load_key(self.key_file)
        stored: list[StoredObject] = []
        reader = TensorReader(self.checkpoint.tensors)
        try:
            for tensor_file in self.files:
                obj = store.tensor_object(tensor_file.name, tensor_file.size_hint)
                try:
                    write_tensor_file(obj, tensor_file, reader, encryption=encryption, on_bytes=on_bytes)
                    stored.append(obj.finish(on_bytes))
                except BaseException:
                    obj.abort()
                    raise
                log.info("%s: %d tensors, %d bytes, sha256 %s", store.uri(tensor_file.name),
                         len(tensor_file.entries), stored[-1].size, stored[-1].sha256)
        finally:
            reader.close()
        for path in self.companions:
            stored.append(store.put_file(path.name, path, on_bytes))
        manifest = Manifest(files=[o.entry() for o in stored], source=str(self.checkpoint.directory), format=FORMAT,
                            tool=f"ferry {__version__}", extra=self._extra(request))
        return self._with_facts(artifact.publish(store, manifest, stored), store)

    def _with_facts(self, published: artifact.Published, store) -> artifact.Published:
        moe = {key: self.moe_facts[key] for key in RESULT_FACTS if key in self.moe_facts}
        return dataclasses.replace(published, facts={"tensorizerUri": store.uri(uri_template(self.layout, self.tp)),
                                                     "layout": self.layout, "tensorParallelSize": self.tp, **moe})

    def _extra(self, request: dict) -> dict:
        import tensorizer

        return {
            "request": request,
            "layout": self.layout,
            "tensorParallelSize": self.tp,
            "vllmVersion": self.vllm_version,
            "architecture": (self.checkpoint.config.get("architectures") or [None])[0],
            "tensorizerVersion": tensorizer.__version__,
            "encrypted": self.key_file is not None,
            # tensorizer_uri is the artifact's URI + "/" + this (vLLM formats %03d with the TP rank).
            "tensorizerUri": uri_template(self.layout, self.tp),
            "tensorFiles": [f.name for f in self.files],
            "tensors": {f.name: len(f.entries) for f in self.files},
            **self.moe_facts,
        }


def _source_identity(checkpoint: Checkpoint) -> dict:
    """The checkpoint's manifest digest when it has one (a fetched directory), else
    its tensors' names, dtypes and shapes and its weight files' sizes and mtimes."""
    if (checkpoint.directory / MANIFEST_NAME).exists():
        return {"manifestDigest": manifest_digest(checkpoint.directory)}
    specs = {name: [spec.dtype, list(spec.shape)] for name, spec in sorted(checkpoint.specs.items())}
    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in checkpoint.weight_files}
    return {"tensorsDigest": "sha256:" + hashlib.sha256(json.dumps(specs, sort_keys=True).encode()).hexdigest(),
            "weightFiles": files}

