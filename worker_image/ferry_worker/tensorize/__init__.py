"""Tensorize and publish: prepared artifacts in an object store (or a local directory).

- `ferry tensorize`: a Hugging Face safetensors checkpoint as tensorizer files,
  in Hugging Face names (`hf` layout, one `model.tensors`) or as vLLM's own
  per-rank modules (`vllm` layout, `model-rank-%03d.tensors`, cut by the same
  rule tables as `ferry shard`, no GPU);
- `ferry publish`: a checkpoint directory as it is (safetensors for
  `--load-format runai_streamer`, or a `ferry shard` artifact);
- `ferry delete-artifact`: exactly the objects an artifact's manifest (or an
  unfinished run's pending record) names, nothing else under the prefix.

Every object is uploaded, then checked (sizes, the store's MD5s against ours,
or a read-back), before `ferry-manifest.json` is written, last. torch and
tensorizer are imported only by the code that serializes or reads tensors:
`ferry publish`, `ferry delete-artifact` and the rest of the worker run without
the `tensorize` extra.
"""
