"""Which tensorizer layouts a vLLM release loads, as read from its sources.

`hf`: one `model.tensors` in the checkpoint's own names. vLLM's
`TensorizerLoader` sees no marker and feeds the tensors to
`model.load_weights`, the same path as its default loader, in every release
Ferry knows (0.8.5 to 0.33.x). With tensor parallelism, vLLM (every release:
`TensorizerConfig.verify_with_parallel_config`) requires a `%0Nd` rank
template in `tensorizer_uri` and opens one file per rank, each of which would
have to hold the whole checkpoint: refused, the `vllm` layout is what TP > 1 is for.

`vllm`: one file per rank (`model.tensors` at TP 1, else
`model-rank-%03d.tensors`, the name vLLM's `tensorize_vllm_model.py`
example uses), holding what vLLM 0.32's `serialize_vllm_model` writes:
the `vllm_tensorized_marker` parameter on the root module (a meta tensor,
so it is stored without data), then every parameter and persistent buffer of
the rank's module tree under its module path, per-rank shapes, a tied LM head
under both `model.embed_tokens.weight` and `lm_head.weight` (two modules share
one parameter there; `load_into_module` needs both, or `lm_head` would stay on
the meta device and `_check_tensors_on_meta_device` would refuse the model).
vLLM's own serializer also writes the non-persistent rotary `cos_sin_cache`;
Ferry leaves it out: the model computes it on construction, and the test
shows the loaded model's buffers equal to those of the default loader.
Verified against vLLM 0.32 (`tensorizer.py`, `tensorizer_loader.py`,
tests/worker/tensorize/test_tensorize_vllm.py); other releases are refused:
their module trees (attention scale buffers, marker handling) were not checked.
"""
from __future__ import annotations

from ..shard.versions import VllmTarget, parse_vllm_version
from .errors import ArtifactError

LAYOUTS = ("hf", "vllm")
VLLM_LAYOUT_RELEASES = ((0, 32),)  # minor releases whose vLLM-tensorized contract was verified
SINGLE_FILE = "model.tensors"
RANK_TEMPLATE = "model-rank-%03d.tensors"


def check_target(layout: str, tp: int, vllm_version: str) -> VllmTarget:
    """The vLLM target for `layout` at tensor parallel size `tp`, or ArtifactError saying why not."""
    if layout not in LAYOUTS:
        raise ArtifactError(f"unknown layout {layout!r} (hf or vllm)")
    if tp < 1:
        raise ArtifactError(f"tensor parallel size must be at least 1, got {tp}")
    try:
        vllm = parse_vllm_version(vllm_version)
    except ValueError as e:
        raise ArtifactError(str(e)) from None
    if layout == "hf" and tp > 1:
        raise ArtifactError(f"the hf layout is one file of Hugging Face tensors; vLLM's tensorizer loader at "
                            f"tensor parallel size {tp} opens one file per rank (a %0Nd template in "
                            f"tensorizer_uri), so it cannot serve it: use --layout vllm for TP > 1")
    if layout == "vllm" and vllm.version[:2] not in VLLM_LAYOUT_RELEASES:
        verified = ", ".join(f"{a}.{b}.x" for a, b in VLLM_LAYOUT_RELEASES)
        raise ArtifactError(f"the vllm layout is verified against vLLM {verified} only (marker, buffers and "
                            f"per-rank module tree of its tensorizer loader); vLLM {vllm} may expect a different "
                            f"file: use --layout hf (TP 1) or --load-format sharded_state")
    return vllm


def tensor_file_names(layout: str, tp: int) -> list[str]:
    if layout == "vllm" and tp > 1:
        return [RANK_TEMPLATE % rank for rank in range(tp)]
    return [SINGLE_FILE]


def uri_template(layout: str, tp: int) -> str:
    """What `tensorizer_uri` ends with, relative to the artifact's prefix."""
    return RANK_TEMPLATE if layout == "vllm" and tp > 1 else SINGLE_FILE
