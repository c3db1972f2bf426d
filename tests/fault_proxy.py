"""An HTTP proxy in front of the S3 server that misbehaves on request.

    with FaultProxy(s3_server.endpoint, rule) as proxy:   # proxy.endpoint for AWS_ENDPOINT_URL
        ...

`rule(request)` sees each request (method, path and query, and how many
UploadPart requests came before) and returns what to do: `PASS`, `("status",
500)` (an S3 InternalError response), `("delay", seconds)` (forward, then
answer late) or `("kill", callback)` (run the callback, e.g. stop the real
server, then drop the connection and stop listening: a server gone mid-upload).
"""
from __future__ import annotations

import http.client
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import urlsplit

PASS = ("pass", None)
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    upload_parts_before: int  # UploadPart requests seen before this one

    @property
    def is_upload_part(self) -> bool:
        return self.method == "PUT" and "partNumber=" in self.path and "uploadId=" in self.path


class FaultProxy:
    def __init__(self, upstream: str, rule: Callable[[Seen], tuple]) -> None:
        self.upstream = urlsplit(upstream)
        self.rule = rule
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy._lock:
                    parts = sum(s.is_upload_part for s in proxy.seen)
                    seen = Seen(self.command, self.path, parts)
                    proxy.seen.append(seen)
                action, arg = proxy.rule(seen)
                if action == "status":
                    payload = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
                               b'<Message>injected by the test proxy</Message></Error>')
                    self.send_response(arg)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                if action == "kill":
                    arg()
                    self.close_connection = True
                    threading.Thread(target=proxy._server.shutdown, daemon=True).start()
                    proxy._server.socket.close()
                    return
                status, headers, data = proxy._forward(self.command, self.path, self.headers, body)
                if action == "delay":
                    threading.Event().wait(arg)
                self.send_response(status)
                head = self.command == "HEAD"  # keeps the upstream's Content-Length: the object's size
                for name, value in headers:
                    if name.lower() not in HOP_BY_HOP and (head or name.lower() != "content-length"):
                        self.send_header(name, value)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.handle_error = lambda request, address: None  # upstream gone on purpose: no tracebacks
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _forward(self, method: str, path: str, headers, body: bytes):
        connection = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            forwarded = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "expect"}
            connection.request(method, path, body=body, headers=forwarded)
            response = connection.getresponse()
            return response.status, response.getheaders(), response.read()
        finally:
            connection.close()

    def upload_parts(self) -> int:
        return sum(s.is_upload_part for s in self.seen)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._server.shutdown()
        finally:
            self._server.server_close()
