"""`ferry shard` and `ferry unshard`: vLLM sharded_state artifacts, cut without a GPU.

- `job`: `ShardJob`, a checkpoint cut into per-rank files;
- `plan` (with `layouts`, `model`, `versions`): which bytes of which tensor go
  to which rank, per model family and vLLM release;
- `source`, `tensors`, `spans`, `write`: reading the checkpoint and writing the rank files;
- `unshard`: the original tensors rebuilt from an artifact, every invariant checked;
- `cli`: the `shard` and `unshard` commands.

Nothing is imported here, so `import ferry_worker.shard.plan` stays light.
"""
