"""A node's link to one router: one DEALER socket (identity = node id), registration,
heartbeats, a non-blocking receive for the node's loop, and whether the connection was lost.
A node with several routers holds one per router (router_links.py). Also the addresses a node
advertises for its endpoints."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.node.step_samples import StepSamples
from pdserve.protocol.messages import (
    MAX_MESSAGE_BYTES,
    Deregister,
    Heartbeat,
    KVResync,
    Message,
    MessageError,
    Register,
    Reregister,
    decode,
)
from pdserve.protocol.sockets import make_socket

logger = logging.getLogger(__name__)


class RouterLink:
    """Heartbeats go out from a thread on their own socket, so a long forward pass (a big prefill
    chunk on a slow CPU) never makes the router think the node died. The loop only refreshes the
    load figures the thread sends (`maybe_heartbeat`); everything else uses the main socket from
    the node's loop alone (ZMQ sockets are not thread-safe).

    Sends never block: while the router is down, ZMQ queues up to SEND_HWM messages for it and
    drops the rest (tokens of requests a restarted router will not know anyway). A `Reregister`
    from the router is answered here, in `poll`: the node registers again.

    `connection_lost` tells the loop that an established connection to the router closed (its
    process exited or was killed: the kernel closed its socket), from the socket's monitor:
    whatever that router sent the node, nobody waits for any more."""

    SEND_HWM = 100_000

    def __init__(self, router_addr: str, register: Register, *, heartbeat_s: float = 1.0,
                 ctx: zmq.Context | None = None, curve=None, step_samples: StepSamples | None = None) -> None:
        self.register_msg = register
        # The node's engine step samples: each heartbeat carries those recorded since this link's last one.
        self.step_samples = step_samples if step_samples is not None else StepSamples()
        self._samples_sent = 0  # the last sample's sequence number a heartbeat of this link carried
        self.heartbeat_s = heartbeat_s
        self.router_addr = router_addr
        self.ctx = ctx or zmq.Context.instance()
        self.curve = curve  # protocol.curve.CurveKeys: authenticate to a CURVE router
        self.num_dropped = 0  # messages dropped because the router was unreachable
        self.num_reregistered = 0
        self.num_registers = 0  # Registers sent: the KV event publisher snapshots after each (node/kv_events.py)
        self.kv_resync = False  # the router asked for a snapshot of the caches (KVResync)
        self.sock = self._socket(register.node_id)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.connected: bool | None = None  # as the monitor last said (None: no event yet)
        self._last_refresh = 0.0
        self._latest: Heartbeat | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.registered = False

    def _socket(self, identity: str) -> zmq.Socket:
        # The receive side keeps libzmq's default queue (hwm=None); only sends may pile up.
        return make_socket(zmq.DEALER, connect=self.router_addr, identity=identity.encode(),
                           max_msg_bytes=MAX_MESSAGE_BYTES, hwm=None, send_hwm=self.SEND_HWM, curve=self.curve,
                           ctx=self.ctx)

    def send(self, msg: Message) -> bool:
        """Queue `msg` for the router; False (and the message dropped) when its queue is full."""
        try:
            self.sock.send(msg.encode(), zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            self.num_dropped += 1
            if self.num_dropped in (1, 10, 100) or self.num_dropped % 1000 == 0:
                logger.warning("router unreachable: dropped %d messages (latest: %s)", self.num_dropped, msg.TYPE)
            return False

    def register(self) -> None:
        self.send(self.register_msg)
        self.num_registers += 1
        self.registered = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
            self._thread.start()

    def deregister(self) -> None:
        if self.registered:
            self.send(Deregister(node_id=self.register_msg.node_id))
            self.registered = False

    def maybe_heartbeat(self, make: Callable[[], Heartbeat]) -> None:
        """Refresh the load figures the heartbeat thread sends (at most twice per period)."""
        now = time.monotonic()
        if now - self._last_refresh >= self.heartbeat_s / 2:
            self._last_refresh = now
            self.set_heartbeat(make())

    def set_heartbeat(self, heartbeat: Heartbeat) -> None:
        """The heartbeat the thread sends from now on."""
        self._latest = heartbeat

    def each(self) -> list[RouterLink]:
        """The link to each router: this one (RouterLinks has one per router)."""
        return [self]

    def origin(self, request_id: str) -> str:
        """The router a request came from: with one router, this one (router_links.py keeps a table)."""
        return self.router_addr

    def adopt(self, request_id: str, router_addr: str) -> None:
        """A request that came through a peer (a decode node's KVReady): with one router, nothing to note."""

    def pollables(self) -> list[zmq.Socket]:
        """What a poller waits on for this link: the socket, and its monitor."""
        return [self.sock] + ([self._monitor] if self._monitor is not None else [])

    def connection_lost(self) -> bool:
        """True when the connection to the router closed since the last call (ZMQ reconnects on
        its own; `connected` follows)."""
        lost = False
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event in (zmq.EVENT_CONNECTED, zmq.EVENT_DISCONNECTED):
                self.connected = event == zmq.EVENT_CONNECTED
                lost |= not self.connected
        return lost

    def _beat(self) -> None:
        # The router keys heartbeats by node_id, so this socket needs an identity of its own.
        sock = self._socket(f"{self.register_msg.node_id}#heartbeat")
        try:
            while not self._stop.wait(self.heartbeat_s):
                latest = self._latest
                if latest is not None and self.registered:
                    rows, self._samples_sent = self.step_samples.since(self._samples_sent)
                    sock.send(dataclasses.replace(latest, step_samples=rows).encode())
        finally:
            sock.close(linger=0)

    def poll(self, timeout_ms: int = 0) -> list[Message]:
        """Messages from the router for the node (a Reregister is handled here); garbage is
        logged and dropped."""
        out: list[Message] = []
        if not self.sock.poll(timeout_ms):
            return out
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = decode(frame)
            except MessageError as e:
                logger.warning("dropped a malformed message from the router: %s", e)
                continue
            if isinstance(msg, Reregister):
                if self.registered:  # not while draining: the node has left
                    logger.info("the router does not know us (%s): registering again", msg.reason)
                    self.num_reregistered += 1
                    self.send(self.register_msg)
                    self.num_registers += 1
            elif isinstance(msg, KVResync):
                self.kv_resync = True
            else:
                out.append(msg)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s)
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self.sock.close(linger=0)


def advertise_host(bind_host: str, advertise: str | None = None) -> str:
    """The host peers should use to reach this node's endpoints: `advertise` when given; else the
    bind host, except that a wildcard bind (0.0.0.0, e.g. in a container) advertises this
    machine's own address, so each replica of a scaled service registers itself, not the
    service name."""
    if advertise:
        return advertise
    if bind_host in ("0.0.0.0", "", "*", "::"):
        return socket.gethostbyname(socket.gethostname())
    return bind_host


def advertised_addr(bound_addr: str, host: str) -> str:
    """`tcp://0.0.0.0:9200` bound → `tcp://HOST:9200` for peers."""
    port = bound_addr.rsplit(":", 1)[1]
    return f"tcp://{host}:{port}"


def host_id() -> str:
    """A hint for same-host probing (never trusted alone: the probe decides)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"
