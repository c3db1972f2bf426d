"""Stopping an offline vLLM engine in the scripts the vLLM tests run in vLLM's own venv
(worker/shard/vllm_generate.py, worker/tensorize/vllm_tensorizer.py). Imports nothing of Ferry's."""
from __future__ import annotations


def shutdown(llm) -> None:
    """The engine's processes stopped. vLLM 0.32's kill_process_tree lists a worker's children and then names
    each: one that exited meanwhile raises NoSuchProcess (it is gone, as asked; a rehearsal's run died of it),
    and the rest are shut down by a second call."""
    import psutil

    try:
        llm.llm_engine.engine_core.shutdown()
    except psutil.NoSuchProcess:
        llm.llm_engine.engine_core.shutdown()
