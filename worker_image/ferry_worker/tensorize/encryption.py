"""Optional encryption with tensorizer's own EncryptionParams (XSalsa20-Poly1305
per chunk, libsodium). The key file holds the 32 raw key bytes, which is what
vLLM's `encryption_keyfile` reads (`DecryptionParams.from_key(file bytes)`).
The key is never logged or stored; the manifest records a fingerprint
(SHA-256 of a fixed label and the key, 16 hex digits) so a rerun with another
key is not mistaken for the same artifact.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .errors import ArtifactError

KEY_BYTES = 32


def load_key(path: Path) -> tuple[Any, str]:
    """(EncryptionParams, fingerprint) from a key file, or ArtifactError naming the problem (not the key)."""
    try:
        key = Path(path).read_bytes()
    except OSError as e:
        raise ArtifactError(f"encryption key file {path}: {e.strerror or e}") from None
    if len(key) != KEY_BYTES:
        raise ArtifactError(f"encryption key file {path} holds {len(key)} bytes; it must hold exactly "
                            f"{KEY_BYTES} raw bytes (e.g. head -c 32 /dev/urandom > key), as vLLM's "
                            f"encryption_keyfile reads it")
    from tensorizer import EncryptionParams

    return EncryptionParams(key), fingerprint(key)


def fingerprint(key: bytes) -> str:
    return hashlib.sha256(b"ferry tensorize key fingerprint\0" + key).hexdigest()[:16]
