"""The router's control socket: one ZMQ ROUTER socket that every node connects to.

Each message is [identity, kvtransfer.messages.encode(msg)]; nodes connect DEALER sockets whose
identity is their node_id. The receive loop hands each decoded message to the router's handler
(router/handlers.py); a message it cannot decode (garbage, a wrong frame count, an unknown type or
protocol version) and any error the handler raises are logged, and the loop goes on. What the
router sends on it, and who decides to:

    PrefillRequest  to the chosen prefill node, naming the decode node ("" = decode it yourself)
                    (router.py: submit, redispatch.py: re-dispatch and unparking)
    Abort           to every live node holding the request, when the client goes away, when a
                    stop string ends it, when its deadline passes, when it is re-dispatched
                    (router.py, redispatch.py, monitor.py), and when a heartbeat lists a request
                    the router does not place on that node (handlers.py)
    Reregister      to a node whose heartbeat the router does not recognise (handlers.py)

Sends never block: a node that stopped reading, or one that is not connected, makes the send
fail (ROUTER_MANDATORY), and the caller decides what that means.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from pdserve.kvtransfer.messages import MAX_MESSAGE_BYTES, Message, MessageError, decode, encode
from pdserve.kvtransfer.sockets import endpoint, make_socket

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + (64 << 10)  # a peer that sends a bigger frame is dropped by libzmq
MessageHandler = Callable[[bytes, Message], Awaitable[None]]  # (sender identity, message)


class ControlSocket:
    """The bound ROUTER socket, its receive loop and its sends. `addr` is the address really bound
    (the port chosen for ":0"), once `open` ran."""

    def __init__(self, bind_addr: str, *, curve=None) -> None:
        self.bind_addr = bind_addr
        self.curve = curve  # kvtransfer.curve.CurveKeys: only nodes holding the cluster's keys get in
        self.addr = ""
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None

    def open(self) -> str:
        """Bind the socket; returns the bound address."""
        self._ctx = zmq.asyncio.Context()
        try:
            # hwm=None: libzmq's default queues (1000 messages per peer); past them a send fails (NOBLOCK)
            self._sock = make_socket(zmq.ROUTER, bind=self.bind_addr, max_msg_bytes=MAX_FRAME_BYTES,
                                     hwm=None, curve=self.curve, ctx=self._ctx)
        except BaseException:
            self._term_context()
            raise
        self.addr = endpoint(self._sock)
        return self.addr

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._term_context()

    def _term_context(self) -> None:
        if self._ctx is None:
            return
        if self.curve is not None:
            from pdserve.kvtransfer.curve import stop_authenticator

            stop_authenticator(self._ctx)  # before term(), which would wait for it forever
        self._ctx.term()
        self._ctx = None

    async def recv_loop(self, handle: MessageHandler) -> None:
        """Receive messages one at a time and await `handle` on each, until cancelled."""
        while True:
            frames = await self._sock.recv_multipart()
            try:
                await handle(*_decode(frames))
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


def _decode(frames: list[bytes]) -> tuple[bytes, Message]:
    if len(frames) != 2:
        raise MessageError(f"expected one frame after the identity, got {len(frames) - 1}")
    identity, data = frames
    return identity, decode(data)
