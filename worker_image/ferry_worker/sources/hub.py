"""hf://org/name through huggingface_hub: listing with sizes and hashes, pinned downloads.

The revision (branch, tag or commit) is resolved to a commit once, when
listing, and every download is pinned to that commit, so a push during the
fetch cannot mix two versions. huggingface_hub does the transfer (hf_xet when
the repository is Xet-backed, resumable HTTP otherwise) and honours its usual
environment: HF_TOKEN (set from the ModelWeights' credentials Secret),
HF_ENDPOINT (a mirror or proxy), HF_HUB_OFFLINE.

Content checks: LFS files carry their sha256 in the listing; small (non-LFS)
files carry their git blob id, a sha1 over "blob <size>\\0" + content.

Offline (HF_HUB_OFFLINE=1), the checkpoint comes from the local Hub cache:
the cached snapshot of the revision is read like any local directory.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from tqdm.auto import tqdm

from ..paths import safe_relative_path
from .base import DownloadSource, RemoteFile, SourceError
from .local import LocalSource


class HubSource(DownloadSource):
    def __init__(self, repo_id: str, revision: str, uri: str, staging: Path) -> None:
        self.repo_id = repo_id
        self.requested_revision = revision
        self.revision: str | None = None  # the commit, once listed
        self.uri = uri
        # huggingface_hub downloads here first (and keeps its resumable
        # `.incomplete` files here), on the output's filesystem.
        self._staging = staging

    def list_files(self) -> list[RemoteFile]:
        info = HfApi().model_info(self.repo_id, revision=self.requested_revision, files_metadata=True)
        if not info.sha or info.siblings is None:
            raise SourceError(f"{self.uri}: the Hub returned no commit or file list for revision {self.requested_revision!r}")
        self.revision = info.sha
        files = []
        for sibling in info.siblings:
            path = safe_relative_path(sibling.rfilename, origin=self.uri)
            if sibling.size is None or sibling.blob_id is None:
                raise SourceError(f"{self.uri}: the Hub listed {path} without size or blob id")
            if sibling.lfs is not None:
                files.append(RemoteFile(path, sibling.size, version=sibling.lfs.sha256, sha256=sibling.lfs.sha256))
            else:
                files.append(RemoteFile(path, sibling.size, version=sibling.blob_id, digests={"git-sha1": sibling.blob_id}))
        return files

    def download(self, file: RemoteFile, dest: Path, on_bytes: Callable[[int], None]) -> None:
        if self.revision is None:
            raise RuntimeError("list_files() pins the revision before any download")
        downloaded = hf_hub_download(
            self.repo_id,
            file.path,
            revision=self.revision,
            local_dir=self._staging,
            tqdm_class=_progress_class(on_bytes),
        )
        Path(downloaded).replace(dest)


def offline_snapshot(repo_id: str, revision: str, uri: str) -> LocalSource:
    """The cached snapshot of `revision`, as a local source (HF_HUB_OFFLINE=1)."""
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError as e:
        raise SourceError(f"{uri}: offline mode and revision {revision!r} is not in the local Hub cache: {e}") from None
    # Snapshot folders are named by commit; their files link into the repository's blob store
    # (models--org--name/blobs), which huggingface_hub wrote: links may point there.
    folder = folder.resolve()
    return LocalSource(folder, uri, revision=folder.name, links_within=folder.parents[1])


def _progress_class(on_bytes: Callable[[int], None]) -> Any:
    """A tqdm class huggingface_hub can drive, forwarding byte counts instead of drawing."""

    class _Forward(tqdm):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            on_bytes(int(n or 0))
            return None

    return _Forward
