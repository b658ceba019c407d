"""A node's small HTTP endpoint, in a daemon thread:

    GET /status   JSON from the node's `status()` (`{"ready": false}` until it is ready)
    GET /metrics  Prometheus text from the node's metrics (404 until it is ready)
    GET /health   200 once ready (model loaded and warmed up), else 503

It starts before the model loads, so a container health check sees "not ready" rather than a
refused connection; `set_ready(status, metrics)` hands it the node's two read-only callbacks
(they run in this server's threads: they only read counters).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.node.metrics import CONTENT_TYPE


def _not_ready() -> dict:
    return {"ready": False}


class StatusServer:
    """`url` names `advertise_host` (default: the bind host) so peers on other machines can reach it."""

    def __init__(self, host: str, port: int, *, advertise_host: str | None = None) -> None:
        self._status: Callable[[], dict] = _not_ready
        self._metrics: Callable[[], bytes] | None = None
        self.ready = False
        self.server = ThreadingHTTPServer((host, port), self._handler_class())
        self.url = f"http://{advertise_host or host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="status-http")
        self.thread.start()

    def set_ready(self, status: Callable[[], dict], metrics: Callable[[], bytes] | None = None) -> None:
        """The node is warmed up: serve its status and metrics, and /health turns 200."""
        self._status, self._metrics = status, metrics
        self.ready = True  # last: a request that sees ready also sees the callbacks

    def respond(self, path: str) -> tuple[int, str, bytes]:
        """(status code, content type, body) for a GET of `path`."""
        if path.startswith("/status"):
            return 200, "application/json", json.dumps(self._status()).encode()
        if path.startswith("/metrics") and self._metrics is not None:
            return 200, CONTENT_TYPE, self._metrics()
        if path.startswith("/health"):
            return (200, "application/json", b'{"status": "ok"}') if self.ready else \
                (503, "application/json", b'{"status": "loading"}')
        return 404, "application/json", b'{"error": "not found"}'

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                code, content_type, body = server.respond(self.path)
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
