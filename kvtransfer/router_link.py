"""A node's link to the router: one DEALER socket (identity = node id), registration,
heartbeats, and a non-blocking receive for the node's loop. Also the small HTTP endpoint every
node serves for its status (and, later, metrics)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import zmq

from kvtransfer.messages import (
    MAX_MESSAGE_BYTES,
    Deregister,
    Heartbeat,
    Message,
    MessageError,
    Register,
    decode,
)

logger = logging.getLogger(__name__)


class RouterLink:
    def __init__(self, router_addr: str, register: Register, *, heartbeat_s: float = 1.0,
                 ctx: zmq.Context | None = None) -> None:
        self.register_msg = register
        self.heartbeat_s = heartbeat_s
        self.sock = (ctx or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, register.node_id.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.connect(router_addr)
        self._last_heartbeat = 0.0
        self.registered = False

    def send(self, msg: Message) -> None:
        self.sock.send(msg.encode(), copy=False)

    def register(self) -> None:
        self.send(self.register_msg)
        self.registered = True

    def deregister(self) -> None:
        if self.registered:
            self.send(Deregister(node_id=self.register_msg.node_id))
            self.registered = False

    def maybe_heartbeat(self, make: Callable[[], Heartbeat]) -> None:
        """Heartbeat when due. Registration is repeated in every beat's place after a router
        restart would otherwise forget us; the router treats a repeated Register as a refresh."""
        now = time.monotonic()
        if now - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = now
            self.send(make())

    def poll(self, timeout_ms: int = 0) -> list[Message]:
        """Messages from the router; garbage is logged and dropped."""
        out: list[Message] = []
        if not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                out.append(decode(frame))
            except MessageError as e:
                logger.warning("dropped a malformed message from the router: %s", e)

    def close(self) -> None:
        self.sock.close(linger=0)


class StatusServer:
    """GET /status → JSON from `status()`; GET /health → 200. Runs in a daemon thread."""

    def __init__(self, host: str, port: int, status: Callable[[], dict]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.startswith("/status"):
                    body, code = json.dumps(status()).encode(), 200
                elif self.path.startswith("/health"):
                    body, code = b'{"status": "ok"}', 200
                else:
                    body, code = b'{"error": "not found"}', 404
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="status-http")
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def host_id() -> str:
    """A hint for same-host probing (never trusted alone: the probe decides)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"


def serve_node(node, link: RouterLink, *, stop_flag: list[bool]) -> None:
    """A node's life: register, loop until asked to stop, then drain — deregister so the router
    sends nothing new, finish what the node holds, and return. `stop_flag[0]` is set by the
    caller's SIGTERM/SIGINT handler (sockets are only touched from this loop)."""
    link.register()
    deregistered = False
    while True:
        node.run_once()
        if stop_flag[0]:
            if not deregistered:
                node.draining = True
                link.deregister()
                deregistered = True
                logger.info("%s draining", link.register_msg.node_id)
            if node.is_idle():
                return
