"""`ferry cache fill-slot`: what a fill pod runs. The node agent mounted the
entry's slot (its staging directory) into the pod; the pod reads the artifact
with its own rights (the user's claim, mounted read-only) and copies into the
slot, each file verified as it is written. The pod is trusted with nothing:
once it ends, the agent takes the slot over and verifies every byte again
before it publishes the entry (store.adopt)."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..load.selection import select
from ..manifest import MANIFEST_NAME, Manifest
from .store import is_digest, source_manifest_bytes, copy_into, keep_verified

log = logging.getLogger(__name__)
# What a fill pod says when the agent mounted the published entry itself: the entry is on the node,
# verified (the operator's proof that a node is warm: node_cache.py).
ALREADY_COMPLETE = "cache entry already complete"


def fill_slot(slot: Path, source: Path, digest: str, ranks: list[int] | None) -> str:
    """Fill `slot` from `source`; resumes what a killed fill left. Returns a line saying what it did."""
    done = slot / MANIFEST_NAME
    if not os.access(slot, os.W_OK) and done.is_file() and is_digest(done.read_bytes(), digest):
        return ALREADY_COMPLETE  # the agent mounted the published entry itself (read-only): nothing to fill
    manifest_bytes = source_manifest_bytes(source, digest)
    wanted = select(Manifest.from_json(manifest_bytes), ranks).entries
    kept = keep_verified(slot, wanted, digest)
    missing = [e for e in wanted if e.path not in kept]
    log.info("filling %d of %d files (%d bytes) into the cache slot; %d kept from an earlier fill",
             len(missing), len(wanted), sum(e.size for e in missing), len(kept))
    copy_into(slot, source, manifest_bytes, missing)
    return f"{slot}: filled {len(missing)} files, {sum(e.size for e in missing)} bytes"
