"""Thin pyzmq helpers: one context per process, sockets with bounded sizes, typed send/recv.

A message on the wire is ``[identity (ROUTER only)] header *payload_frames``: the header is a
msgpack `Message` (protocol.messages), payload frames are raw bytes sent without copying.
`recv_msg` raises `MessageError` for anything it cannot decode; callers log it and drop it.
With `curve` keys a bound socket is a CURVE server and a connecting one a CURVE client (protocol.curve).
"""

from __future__ import annotations

import os

import zmq

from pdserve.protocol.curve import CurveKeys, OnRefused, apply_client, apply_server
from pdserve.protocol.messages import MAX_MESSAGE_BYTES, Message, MessageError, decode

CONTROL_MAX_BYTES = MAX_MESSAGE_BYTES  # a control socket never accepts a bigger frame
# A KV socket takes payload frames up to this (a 2048-token SmolLM2 request is 47 MB in bf16).
KV_MAX_BYTES = int(os.environ.get("PDSERVE_KV_MAX_FRAME_BYTES", 4 << 30))
DEFAULT_HWM = 10_000  # queued messages per peer before a send would block (we send NOBLOCK)


def context() -> zmq.Context:
    """The process-wide ZMQ context."""
    return zmq.Context.instance()


def make_socket(kind: int, *, bind: str | None = None, connect: str | None = None,
                identity: bytes | None = None, max_msg_bytes: int = CONTROL_MAX_BYTES,
                hwm: int | None = DEFAULT_HWM, curve: CurveKeys | None = None, ctx: zmq.Context | None = None,
                send_hwm: int | None = None, on_refused: OnRefused | None = None,
                handover: bool = True) -> zmq.Socket:
    """A socket with LINGER 0 and a bounded inbound frame size (a peer that sends a bigger frame is
    disconnected by libzmq). ``bind="tcp://127.0.0.1:0"`` picks a free port: see `endpoint`.
    `hwm` bounds the queues both ways (None: libzmq's default, 1000 messages); `send_hwm`, when
    given, overrides the send side alone. A ROUTER is MANDATORY (a send to an unknown peer raises)
    and, unless `handover=False`, HANDOVER (a reconnecting peer takes its identity back).
    With `curve` it binds as a CURVE server (the context's ZAP authenticator started first) or
    connects as a CURVE client; it must then do one of the two, not both. `ctx` defaults to the
    process-wide context (pass a `zmq.asyncio.Context` for an asyncio socket). `on_refused` (a
    CURVE server only) is told of every client key the authenticator refuses (`apply_server`).

    Every socket of the project comes from here, e.g.
        the router's control socket: make_socket(zmq.ROUTER, bind=addr, ctx=asyncio_ctx, curve=keys,
                                                 max_msg_bytes=MAX_MESSAGE_BYTES + (64 << 10), hwm=None,
                                                 on_refused=count, handover=keys is None)
        a node's link to it:         make_socket(zmq.DEALER, connect=addr, identity=node_id.encode(),
                                                 hwm=None, send_hwm=100_000, curve=keys)
        a decode node's KV socket:   make_socket(zmq.ROUTER, bind=addr, max_msg_bytes=KV_MAX_BYTES, curve=keys,
                                                 on_refused=count)
        a prefill node's KV link:    make_socket(zmq.DEALER, connect=kv_addr, identity=..., curve=keys)
    """
    if curve is not None and (bind is None) == (connect is None):
        raise ValueError("a CURVE socket either binds (server) or connects (client)")
    sock = (ctx or context()).socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    if hwm is not None:
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    if send_hwm is not None:
        sock.setsockopt(zmq.SNDHWM, send_hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unknown peer raises instead of a silent drop
        sock.setsockopt(zmq.ROUTER_HANDOVER, int(handover))  # a reconnecting peer takes its identity back
    try:
        if curve is not None and bind is not None:
            apply_server(sock, curve, on_refused=on_refused)
        elif curve is not None:
            apply_client(sock, curve)
        if bind is not None:
            sock.bind(_wildcard_port(bind))
        if connect is not None:
            sock.connect(connect)
    except zmq.ZMQError:
        sock.close(0)
        raise
    return sock


def _wildcard_port(addr: str) -> str:
    return addr[:-2] + ":*" if addr.startswith("tcp://") and addr.endswith(":0") else addr


def endpoint(sock: zmq.Socket) -> str:
    """The address a socket really bound (the port chosen for ``:0``)."""
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def send_msg(sock: zmq.Socket, msg: Message, *frames, identity: bytes | None = None,
             flags: int = zmq.NOBLOCK) -> None:
    """Send a header and payload frames as one multipart message. Payload frames (buffers, e.g.
    from `payload.tensor_to_frame`) are not copied. Non-blocking by default: raises zmq.Again when
    the peer's queue is full and zmq.ZMQError (EHOSTUNREACH) when a ROUTER does not know `identity`."""
    parts = [msg.encode(), *frames]
    if identity is not None:
        parts.insert(0, identity)
    sock.send_multipart(parts, flags=flags, copy=False)


def recv_msg(sock: zmq.Socket, flags: int = 0) -> tuple[bytes | None, Message, list[memoryview]]:
    """Receive one multipart message: (peer identity on a ROUTER else None, header, payload frames).

    Raises zmq.Again (NOBLOCK, nothing queued) or MessageError (garbage: the message is consumed).
    """
    parts = sock.recv_multipart(flags, copy=False)
    identity = None
    if sock.type == zmq.ROUTER:
        identity, parts = parts[0].bytes, parts[1:]
    if not parts:
        raise MessageError(f"empty message from {identity!r}")
    try:
        msg = decode(parts[0].buffer)
    except MessageError as e:
        raise MessageError(f"from {identity!r}: {e}") from None
    return identity, msg, [p.buffer for p in parts[1:]]


def drain(sock: zmq.Socket, limit: int = 1000):
    """Yield (identity, message, frames) for every message queued now, without blocking.

    Garbage is yielded as (identity, MessageError, []) so the caller can log it and go on.
    """
    for _ in range(limit):
        try:
            yield recv_msg(sock, zmq.NOBLOCK)
        except zmq.Again:
            return
        except MessageError as e:
            yield None, e, []
