"""Images into a containerd, through its ctr client (no CRI needed)."""
from __future__ import annotations

import subprocess
from pathlib import Path

NAMESPACE = "k8s.io"  # the CRI plugin's namespace: what kubelet sees


def _ctr(address: str, namespace: str, *args: str) -> str:
    return subprocess.run(["ctr", "--address", address, "-n", namespace, *args],
                          check=True, capture_output=True, text=True).stdout


def images(address: str, namespace: str = NAMESPACE) -> dict[str, str]:
    """ref -> manifest digest of every image the containerd holds in namespace."""
    present = {}
    for line in _ctr(address, namespace, "images", "ls").splitlines()[1:]:
        cols = line.split()  # REF TYPE DIGEST SIZE PLATFORMS LABELS
        if len(cols) >= 3 and cols[2].startswith("sha256:"):
            present[cols[0]] = cols[2]
    return present


def import_archive(address: str, archive: Path, namespace: str = NAMESPACE) -> None:
    _ctr(address, namespace, "images", "import", "--all-platforms", str(archive))
