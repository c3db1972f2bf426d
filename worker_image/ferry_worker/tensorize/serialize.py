"""Write one tensorizer file with tensorizer's own `TensorSerializer` (torch and
tensorizer are imported here, and only here and in encryption.py).

Tensors are written one at a time with `write_tensor`, which returns once all
of that tensor's writes (data, then its header with CRC32 and SHA-256) are
done; the object is then sealed up to there, so at most one tensor (plus the
prologue and the parts in flight) is in memory. The layout of the file is the
one `write_module` produces: entries back to back after the 256 KiB metadata
index, each with its module path, PARAM or BUFFER, dtype and shape.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..shard.plan import PlannedTensor
from ..shard.spans import BlockBuffers
from ..shard.tensors import TensorLocation
from ..shard.write import SourceFiles, tensor_bytes
from .layouts import BUFFER, TensorEntry, TensorFile
from .store import TensorObject

TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class TensorReader:
    """Bytes of planned (per-rank) tensors and of checkpoint tensors, as torch tensors over fresh buffers
    (tensorizer encrypts a tensor's memory in place, so it must not be a view of the checkpoint)."""

    def __init__(self, locations: Mapping[str, TensorLocation]) -> None:
        self._sources = SourceFiles(locations)
        self._buffers = BlockBuffers()

    def close(self) -> None:
        self._sources.close()

    def tensor(self, entry: TensorEntry) -> Any:
        import torch

        dtype = getattr(torch, TORCH_DTYPES[entry.dtype])
        if entry.meta:
            return torch.empty(entry.shape, dtype=dtype, device="meta")
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=dtype)
        data = bytearray(entry.nbytes)
        view, position = memoryview(data), 0
        for chunk in self._chunks(entry):
            view[position:position + len(chunk)] = chunk
            position += len(chunk)
        if position != entry.nbytes:
            raise AssertionError(f"{entry.name}: {position} bytes read, {entry.nbytes} expected")
        return torch.frombuffer(data, dtype=dtype).reshape(entry.shape)

    def _chunks(self, entry: TensorEntry):
        source = entry.source
        if isinstance(source, PlannedTensor):
            yield from tensor_bytes(source, self._sources, self._buffers)
        elif isinstance(source, TensorLocation):
            from ..shard.spans import Span, read_span

            yield from read_span(self._sources.fd(source.name), Span(source.offset, source.nbytes), self._buffers)
        else:
            raise AssertionError(entry)


def write_tensor_file(obj: TensorObject, tensor_file: TensorFile, reader: TensorReader, *,
                      encryption: Any = None, on_bytes: Callable[[int], None] | None = None) -> None:
    """Serialize `tensor_file` into `obj.file`; the caller then calls `obj.finish()`."""
    from tensorizer import TensorSerializer
    from tensorizer.serialization import TensorType

    serializer = TensorSerializer(obj.file, encryption=encryption)
    try:
        for entry in tensor_file.entries:
            kind = TensorType.BUFFER if entry.kind == BUFFER else TensorType.PARAM
            # Module index 0 for every entry: tensorizer records it, no loader reads it.
            serializer.write_tensor(0, entry.name, kind, reader.tensor(entry))
            obj.seal()
            if on_bytes:
                on_bytes(entry.nbytes)
        serializer.close()
    except BaseException:
        _discard(serializer)
        raise


def _discard(serializer: Any) -> None:
    """Stop a failed serializer's thread pools without finishing the file."""
    shutdown = getattr(serializer, "_shutdown_thread_pools", None)
    if callable(shutdown):
        shutdown()
