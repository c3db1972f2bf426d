"""What can go wrong, sorted by whether a retry could help."""
from __future__ import annotations


class ArtifactError(ValueError):
    """The request is wrong (checkpoint, layout, version, key file, output):
    the same command fails the same way, so a prepare Job does not retry it."""


class StoreError(RuntimeError):
    """The object store failed or disagreed with what was sent, after retries.
    Nothing is published (no manifest); a rerun starts the upload again."""


class MissingExtraError(RuntimeError):
    """torch or tensorizer is not installed (the `tensorize` extra)."""


def require_tensorizer() -> None:
    """Import torch and tensorizer, or say which extra installs them."""
    try:
        import tensorizer  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(f"ferry tensorize needs torch and tensorizer (pip install 'ferry[tensorize]'): "
                                f"{e}") from None
