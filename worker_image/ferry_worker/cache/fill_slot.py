"""`ferry cache fill-slot`: what a fill pod runs. The node agent mounted the
entry's slot (its staging directory) into the pod; the pod reads the artifact
with its own rights (the user's claim, mounted read-only, or the S3 prefix
with the ModelWeights' credentials: s3_source.py) and copies into the slot,
each file verified as it is written. The pod is trusted with nothing:
once it ends, the agent takes the slot over and verifies every byte again
before it publishes the entry (store.adopt)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..load.selection import select
from ..manifest import Manifest, read_manifest_bytes
from .s3_source import download_into, open_source, s3_manifest_bytes
from .store import is_digest, source_manifest_bytes, copy_into, keep_verified

log = logging.getLogger(__name__)
# What a fill pod says when the agent mounted the published entry itself: the entry is on the node,
# verified (the operator's proof that a node is warm: node_cache.py).
ALREADY_COMPLETE = "cache entry already complete"


def fill_slot(slot: Path, source: str | Path, digest: str, ranks: list[int] | None) -> str:
    """Fill `slot` from `source` (a directory or s3://bucket/prefix); resumes what a killed fill left.
    Returns a line saying what it did."""
    done = None if os.access(slot, os.W_OK) else read_manifest_bytes(slot)  # never through a symlink
    if done is not None and is_digest(done, digest):
        return ALREADY_COMPLETE  # the agent mounted the published entry itself (read-only): nothing to fill
    source = str(source)
    store = open_source(source) if source.startswith("s3://") else None
    manifest_bytes = (s3_manifest_bytes(store, digest) if store is not None
                      else source_manifest_bytes(Path(source), digest))
    wanted = select(Manifest.from_json(manifest_bytes), ranks).entries
    kept = keep_verified(slot, wanted, digest)
    missing = [e for e in wanted if e.path not in kept]
    log.info("filling %d of %d files (%d bytes) from %s into the cache slot; %d kept from an earlier fill",
             len(missing), len(wanted), sum(e.size for e in missing), source, len(kept))
    if store is not None:
        download_into(slot, store, manifest_bytes, missing)
    else:
        copy_into(slot, Path(source), manifest_bytes, missing)
    return f"{slot}: filled {len(missing)} files, {sum(e.size for e in missing)} bytes"
