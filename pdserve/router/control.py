"""The router's control socket: one ZMQ ROUTER socket that every node connects to.

Each message is [identity, protocol.messages.encode(msg)]; nodes connect DEALER sockets whose
identity is their node_id. The receive loop hands each decoded message to the router's handler
(router/handlers.py); a message it cannot decode (garbage, a wrong frame count, an unknown type or
protocol version) and any error the handler raises are logged, and the loop goes on. What the
router sends on it, and who decides to:

    PrefillRequest  to the chosen prefill node, naming the decode node ("" = decode it yourself)
                    (dispatcher.py; choices.py for an n > 1 request)
    Abort           to every live node holding the request, when the client goes away, when a
                    stop string ends it, when its deadline passes, when it is re-dispatched
                    (dispatcher.py, at the request of the others), and when a heartbeat lists a request
                    the router does not place on that node (handlers.py)
    Reregister      to a node whose heartbeat the router does not recognise (handlers.py)

Sends never block: a node that stopped reading, or one that is not connected, makes the send
fail (ROUTER_MANDATORY), and the caller decides what that means.

With CURVE keys (protocol.curve) the socket is a CURVE server and:

  - every message is received with copy=False so its connection's ZMQ "User-Id" is known: the
    z85 public key the peer authenticated with (pyzmq's authenticator sets it). The handler gets
    it as `peer_key` (None without CURVE), which is what binds a node id to a key (handlers.py).
  - ROUTER_HANDOVER is off: a second connection presenting a routing id already connected (a
    node id, by convention) is ignored by libzmq instead of taking that id over, so a holder of
    another allowed key cannot divert what the router sends to a live node. The price: a
    restarted node gets its routing id back only once libzmq has dropped the old connection,
    which is at once when the old process exited (the kernel closes its socket), but not for a
    connection cut without a FIN or RST (a host that lost power) until TCP gives up on it.
  - refused peers are counted through `on_refused(reason, peer)`: `unknown_key` from the ZAP
    thread, `no_curve` / `handshake` from the socket's monitor, read by a task of the loop
    (`monitor_loop`); the first of those is logged, then one line a minute at most.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from pdserve.protocol.curve import (
    HandshakeFailures,
    OnRefused,
    close_server,
    monitor_handshakes,
    stop_authenticator,
)
from pdserve.protocol.messages import MAX_MESSAGE_BYTES, Message, MessageError, TokenBatch, decode, encode
from pdserve.protocol.sockets import endpoint, make_socket

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + (64 << 10)  # a peer that sends a bigger frame is dropped by libzmq
# (sender identity, message, the sender's CURVE public key in z85, or None without CURVE)
YIELD_EVERY = 32  # control messages handled per turn of the event loop, at most
TURN_BUDGET_S = 0.005  # and this long, at most (a TokenBatch of a big step takes a while)
MAX_BACKLOG = 10_000  # messages read off the socket but not yet handled, at most (then libzmq queues)
MessageHandler = Callable[[bytes, Message, "str | None"], Awaitable[None]]


class ControlSocket:
    """The bound ROUTER socket, its receive loop and its sends. `addr` is the address really bound
    (the port chosen for ":0"), once `open` ran."""

    def __init__(self, bind_addr: str, *, curve=None, on_refused: OnRefused | None = None,
                 on_token_batch: Callable[[float, int], None] | None = None) -> None:
        self.bind_addr = bind_addr
        self.curve = curve  # protocol.curve.CurveKeys: only nodes holding the cluster's keys get in
        self.on_refused = on_refused or (lambda reason, peer: None)  # (reason, peer): may run in the ZAP thread
        self.addr = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._shadow: zmq.Socket | None = None  # the same socket, for non-blocking reads without a future
        # (frames, read at, arrived after): a message read off the socket arrived after the last time
        # the socket was found empty (`_caught_up_at`); `known_until` is built on that
        self.backlog: collections.deque[tuple[list[zmq.Frame], float, float]] = collections.deque()
        self._caught_up_at = time.monotonic()
        # (seconds, tokens) of each TokenBatch decoded: the router's "decode" stage (metrics.py)
        self.on_token_batch = on_token_batch or (lambda seconds, num_tokens: None)

    def open(self) -> str:
        """Bind the socket; returns the bound address."""
        self._ctx = zmq.asyncio.Context()
        try:
            # hwm=None: libzmq's default queues (1000 messages per peer); past them a send fails (NOBLOCK)
            # handover off under CURVE: see the module docstring
            self._sock = make_socket(zmq.ROUTER, bind=self.bind_addr, max_msg_bytes=MAX_FRAME_BYTES, hwm=None,
                                     ctx=self._ctx, curve=self.curve, on_refused=self.on_refused,
                                     handover=self.curve is None)
            if self.curve is not None:
                self._monitor = monitor_handshakes(self._sock)
        except BaseException:
            self.close()
            raise
        self.addr = endpoint(self._sock)
        self._shadow = zmq.Socket.shadow(self._sock.underlying)
        return self.addr

    def close(self) -> None:
        self.backlog.clear()
        self._shadow = None  # a shadow does not own the socket: closing the original closes it
        if self._sock is not None:
            close_server(self._sock, self._monitor)
            self._sock = self._monitor = None
        self._term_context()

    async def monitor_loop(self) -> None:
        """Count the handshakes libzmq failed on the socket (CURVE only; returns at once without),
        until cancelled."""
        if self._monitor is None:
            return
        failures = HandshakeFailures(f"router control socket {self.addr}", self.on_refused)
        while True:
            failures.on_event(await recv_monitor_message(self._monitor))

    def _term_context(self) -> None:
        if self._ctx is None:
            return
        if self.curve is not None:
            stop_authenticator(self._ctx)  # before term(), which would wait for it forever
        self._ctx.term()
        self._ctx = None

    async def recv_loop(self, handle: MessageHandler, yield_every: int = YIELD_EVERY,
                        turn_budget_s: float = TURN_BUDGET_S) -> None:
        """Receive messages and await `handle` on each, until cancelled.

        Fairness: while messages keep arriving, awaiting a receive that is already done never gives
        the event loop back, so the HTTP side (streams to clients, new requests) would starve. So
        each turn takes whatever the socket holds into `backlog` (read off the socket at once, so
        libzmq's per-node queue never fills and drops a node's tokens), handles at most
        `yield_every` messages or `turn_budget_s` seconds of them, and yields. The backlog's
        length and its oldest message's age are the router's control-side saturation."""
        backlog = self.backlog
        while True:
            if not backlog:
                self._caught_up_at = since = time.monotonic()
                backlog.append((await self._sock.recv_multipart(copy=False), time.monotonic(), since))
            self._read_ready()
            start = time.perf_counter()
            for _ in range(yield_every):
                parts, _, _ = backlog.popleft()
                await self._handle(parts, handle)
                if not backlog or time.perf_counter() - start > turn_budget_s:
                    break
            await asyncio.sleep(0)

    def _read_ready(self) -> None:
        """Move every message the socket holds now into the backlog (up to MAX_BACKLOG)."""
        sock, backlog = self._shadow, self.backlog
        now, since = time.monotonic(), self._caught_up_at
        try:
            while len(backlog) < MAX_BACKLOG:
                backlog.append((sock.recv_multipart(zmq.NOBLOCK, copy=False), now, since))
        except zmq.Again:
            self._caught_up_at = now

    def backlog_age_s(self) -> float:
        """How long the oldest message not yet handled has waited since it was read (0: none)."""
        backlog = self.backlog
        return time.monotonic() - backlog[0][1] if backlog else 0.0

    def known_until(self) -> float:
        """The time up to which every message the nodes sent has been handled: what the router can
        tell about a node's silence ends there. Behind by the backlog, and by a stall of the event
        loop (messages waiting in the socket count from the last time it was found empty)."""
        if self.backlog:
            return self.backlog[0][2]
        # Asked of the asyncio socket, not the shadow: reading EVENTS can use up the edge of libzmq's
        # edge-triggered FD, and the asyncio socket then schedules its own check, so a pending
        # receive still wakes for what is waiting.
        if self._sock is not None and self._sock.get(zmq.EVENTS) & zmq.POLLIN:
            return self._caught_up_at
        return time.monotonic()

    async def _handle(self, parts: list[zmq.Frame], handle: MessageHandler) -> None:
        frames = [part.bytes for part in parts]
        peer_key = _user_id(parts[-1]) if self.curve is not None else None
        try:
            start = time.perf_counter()
            identity, msg = _decode(frames)
            if type(msg) is TokenBatch:
                self.on_token_batch(time.perf_counter() - start, len(msg))
            await handle(identity, msg, peer_key)
        except MessageError as e:
            logger.warning("dropped a message from %r: %s", frames[0][:64], e)
        except Exception:  # a bug handling one message must not stop the router
            logger.exception("error handling a message from %r", frames[0][:64])

    async def send(self, identity: bytes, node_id: str, msg: Message, log_level: int = logging.WARNING) -> bool:
        """Send `msg` to the node connected as `identity`; False (logged) when it cannot go out."""
        try:
            data = encode(msg)
        except (ValueError, TypeError, OverflowError) as e:  # a value msgpack cannot carry
            logger.error("cannot encode %s for node %s: %s", msg.TYPE, node_id, e)
            return False
        try:
            # NOBLOCK: a node that stopped reading must not stall the router; the send fails instead.
            await self._sock.send_multipart([identity, data], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            logger.log(log_level, "cannot send %s to node %s: %s", msg.TYPE, node_id, e)
            return False


def _user_id(frame: zmq.Frame) -> str | None:
    """The ZMQ "User-Id" of the connection a frame came from: the z85 CURVE public key that the
    ZAP authenticator admitted. None if libzmq has none (it always has one behind CURVE + ZAP)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


def _decode(frames: list[bytes]) -> tuple[bytes, Message]:
    if len(frames) != 2:
        raise MessageError(f"expected one frame after the identity, got {len(frames) - 1}")
    identity, data = frames
    return identity, decode(data)
