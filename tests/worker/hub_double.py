"""A test double of the Hugging Face Hub (an external service this machine cannot reach).

It implements only what huggingface_hub 2.4.0 calls to list and download a
model repository, with the Hub's observable behaviour (read from
huggingface_hub's file_download.py / hf_api.py):

- GET  /api/models/{repo}/revision/{rev}?blobs=true   -> sha + siblings (size, blobId, lfs.sha256)
- GET  /api/models/{repo}/tree/{rev}?recursive=true   -> the same files as tree entries (snapshot_download)
- HEAD/GET /{repo}/resolve/{rev}/{path}               -> small files: 200, ETag = git blob id;
                                                         LFS files: 302 to the CDN with
                                                         X-Linked-Etag / X-Linked-Size
- HEAD/GET /cdn/{sha256}                              -> the bytes, honouring Range (served on a
                                                         second port: huggingface_hub follows
                                                         redirects only within the Hub's origin)

Faults can be injected: bytes served that differ from the listing
(`serve_instead`), and extra listing entries (`extra_siblings`).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".model")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class HubRepo:
    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    branches: tuple[str, ...] = ("main",)
    serve_instead: dict[str, bytes] = field(default_factory=dict)  # path -> bytes actually served
    extra_siblings: list[dict] = field(default_factory=list)

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def sibling(self, path: str) -> dict:
        data = self.files[path]
        entry = {"rfilename": path, "size": len(data)}
        if self.is_lfs(path):
            sha = hashlib.sha256(data).hexdigest()
            pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
            entry |= {"blobId": git_blob_id(pointer), "lfs": {"sha256": sha, "size": len(data), "pointerSize": len(pointer)}}
        else:
            entry["blobId"] = git_blob_id(data)
        return entry


class FakeHub:
    def __init__(self, repos: dict[str, HubRepo]) -> None:
        self.repos = repos
        self.requests: list[Request] = []
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), self._handler()) for _ in ("hub", "cdn")]
        for server in self._servers:
            server.daemon_threads = True

    @property
    def endpoint(self) -> str:
        return self._url(self._servers[0])

    @property
    def cdn(self) -> str:
        return self._url(self._servers[1])

    @staticmethod
    def _url(server: ThreadingHTTPServer) -> str:
        host, port = server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeHub":
        for server in self._servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def _blob(self, sha256: str) -> bytes | None:
        for repo in self.repos.values():
            for path, data in repo.files.items():
                if repo.is_lfs(path) and hashlib.sha256(data).hexdigest() == sha256:
                    return repo.serve_instead.get(path, data)
        return None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # keep pytest output clean
                pass

            def do_HEAD(self) -> None:
                self._route(body=False)

            def do_GET(self) -> None:
                self._route(body=True)

            def _route(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append(Request(self.command, path, self.headers.get("Range"),
                                            self.headers.get("Authorization")))
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path):
                    return self._model_info(m.group(1), m.group(2))
                if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                    return self._tree(m.group(1), m.group(2))
                if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    return self._resolve(m.group(1), m.group(2), m.group(3), body)
                if m := re.fullmatch(r"/cdn/([0-9a-f]{64})", path):
                    data = hub._blob(m.group(1))
                    if data is None:
                        return self._error(404, "EntryNotFound")
                    return self._content(data, {}, body)
                return self._error(404, "RepoNotFound")

            def _repo(self, repo_id: str, revision: str) -> HubRepo | None:
                repo = hub.repos.get(repo_id)
                if repo is None:
                    self._error(404, "RepoNotFound")
                    return None
                if revision not in (*repo.branches, repo.commit):
                    self._error(404, "RevisionNotFound")
                    return None
                return repo

            def _model_info(self, repo_id: str, revision: str) -> None:
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                siblings = [repo.sibling(p) for p in sorted(repo.files)] + repo.extra_siblings
                data = json.dumps({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "siblings": siblings}).encode()
                self._send(200, {"Content-Type": "application/json"}, data, True)

            def _tree(self, repo_id: str, revision: str) -> None:
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                entries = []
                for sibling in (repo.sibling(p) for p in sorted(repo.files)):
                    entry = {"type": "file", "path": sibling["rfilename"], "size": sibling["size"],
                             "oid": sibling["blobId"]}
                    if "lfs" in sibling:
                        lfs = sibling["lfs"]
                        entry["lfs"] = {"oid": lfs["sha256"], "size": lfs["size"], "pointerSize": lfs["pointerSize"]}
                    entries.append(entry)
                self._send(200, {"Content-Type": "application/json"}, json.dumps(entries).encode(), True)

            def _resolve(self, repo_id: str, revision: str, file_path: str, body: bool) -> None:
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                if file_path not in repo.files:
                    return self._error(404, "EntryNotFound")
                data = repo.files[file_path]
                headers = {"X-Repo-Commit": repo.commit}
                if repo.is_lfs(file_path):
                    sha = hashlib.sha256(data).hexdigest()
                    headers |= {"Location": f"{hub.cdn}/cdn/{sha}", "X-Linked-Etag": f'"{sha}"',
                                "X-Linked-Size": str(len(data)), "ETag": f'"{git_blob_id(data)}"', "Content-Length": "0"}
                    return self._send(302, headers, b"", body)
                headers["ETag"] = f'"{git_blob_id(data)}"'
                self._content(repo.serve_instead.get(file_path, data), headers, body)

            def _content(self, data: bytes, headers: dict, body: bool) -> None:
                start, end, status = 0, len(data), 200
                if m := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
                    start = int(m.group(1))
                    end = int(m.group(2)) + 1 if m.group(2) else len(data)
                    status = 206
                    headers = {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}
                self._send(status, {**headers, "Accept-Ranges": "bytes"}, data[start:end], body)

            def _error(self, status: int, code: str) -> None:
                self._send(status, {"X-Error-Code": code, "Content-Type": "application/json"},
                           json.dumps({"error": code}).encode(), True)

            def _send(self, status: int, headers: dict, data: bytes, body: bool) -> None:
                self.send_response(status)
                headers.setdefault("Content-Length", str(len(data)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if body and self.command != "HEAD":
                    self.wfile.write(data)

        return Handler
