"""`ferry fetch`: a checkpoint's files (vLLM's selection), verified, with a manifest.

- `run`: `FetchRequest` and `fetch`, the steps of a fetch;
- `selection`: the files vLLM would load;
- `transfer`: ranged, resumable, verified transfers (`journal`, `digests`);
- `cli`: the `fetch` and `verify` commands.
"""
