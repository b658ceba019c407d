"""The router's control plane: one ZMQ ROUTER socket that every node connects to, the registry of
live nodes, dispatch of requests to a (prefill, decode) pair, and tokens flowing back to HTTP.

Each ZMQ message is [identity, kvtransfer.messages.encode(msg)]; nodes connect DEALER sockets
whose identity is their node_id. What the router does with each message:

    Register    add the node (replace an entry with the same node_id; if its pid changed the old
                process is gone, so its requests fail). Not eligible until a heartbeat says ready.
    Heartbeat   refresh liveness and load (free blocks, outstanding prompt tokens, ready)
    Deregister  drop the node; its in-flight requests fail (503-style error)
    FirstToken  output index 0 of a request: ends the prompt-token accounting on the prefill node
    TokenBatch  tokens with index >= 1; a token with finish_reason ends the request
    Error       the request fails: 503 if `retryable`, else 500 (an error event once streaming)
    anything else, garbage, wrong frame count: logged and dropped

and what it sends:

    PrefillRequest  to the chosen prefill node, naming the decode node ("" = decode it yourself)
    Abort           to every live node holding the request, when the client goes away, when a
                    stop string ends it, when its deadline passes, and when one of its nodes
                    fails (so the other releases its blocks)

A node missing heartbeats for `heartbeat_timeout_s` is dropped like a Deregister.
`self.metrics` (router/metrics.py) records a request's first token, its end and its errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from kvtransfer.messages import (
    MAX_MESSAGE_BYTES,
    Abort,
    Deregister,
    Error,
    FirstToken,
    Heartbeat,
    Message,
    MessageError,
    PrefillRequest,
    Register,
    Token,
    TokenBatch,
    decode,
    encode,
)
from router.metrics import RouterMetrics
from router.openai_protocol import ParsedRequest, ProtocolError, parse_chat, parse_completion
from router.registry import NodeInfo, NoNodeError, Registry
from router.request_state import RouterError, RouterRequest

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


class Router:
    def __init__(self, tokenizer, served_model_name: str, *, control_addr: str = "tcp://127.0.0.1:0",
                 heartbeat_timeout_s: float = 5.0, prefix_affinity: bool = False,
                 request_timeout_s: float | None = 600.0, metrics: RouterMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.registry = Registry(heartbeat_timeout_s, prefix_affinity=prefix_affinity)
        self.request_timeout_s = request_timeout_s
        self.requests: dict[str, RouterRequest] = {}  # in flight: dispatched and not ended
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.metrics.watch(lambda: len(self.requests),
                           lambda: [(n.role, n.ready) for n in self.registry.nodes.values()])
        self.control_addr = ""  # the bound address, once started
        self._bind_addr = control_addr
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._handlers = {Register: self._on_register, Heartbeat: self._on_heartbeat,
                          Deregister: self._on_deregister, FirstToken: self._on_first_token,
                          TokenBatch: self._on_token_batch, Error: self._on_error}

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to an unconnected node fails instead of vanishing
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted node takes its identity back
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES + (64 << 10))  # bigger frames drop the peer
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self._bind_addr)
        self._sock = sock
        self.control_addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._monitor_loop())]
        logger.info("router control socket bound at %s", self.control_addr)

    async def close(self) -> None:
        for req in list(self.requests.values()):
            await self._fail(req, RouterError("the router is shutting down", 503, "ServiceUnavailableError"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            self._ctx.term()
            self._sock = self._ctx = None

    def is_healthy(self) -> bool:
        return self.registry.is_healthy()

    # ---- requests (called by the HTTP side) ----------------------------------------------
    def parse(self, kind: str, body) -> ParsedRequest:
        """Validate an OpenAI body; raises ProtocolError (4xx)."""
        parse = parse_chat if kind == "chat" else parse_completion
        return parse(body, self.tokenizer, self.served_model_name, self.registry.max_model_len())

    async def submit(self, request_id: str, parsed: ParsedRequest) -> RouterRequest:
        """Pick the nodes and send the PrefillRequest; raises ProtocolError(503) when no node can take it."""
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s else None
        req = RouterRequest(request_id, parsed.prompt_token_ids, parsed.sampling, self.tokenizer, deadline=deadline)
        sampling = parsed.sampling
        try:
            route = self.registry.route(req.prompt_token_ids, sampling.max_tokens)
        except NoNodeError as e:
            raise ProtocolError(f"no ready {e} node is registered", status=503) from None
        req.mark_dispatched(route.prefill.node_id, route.decode.node_id if route.decode else "")
        self.requests[request_id] = req
        self.registry.add_request(route, request_id, len(req.prompt_token_ids), sampling.max_tokens)
        msg = PrefillRequest(request_id, req.prompt_token_ids, sampling.to_dict(), req.decode_node_id,
                             route.decode.register.kv_addr if route.decode else "",
                             arrival_time=req.timing.arrival_wall)
        if not await self._send(route.prefill, msg):
            self._forget(req)
            raise ProtocolError(f"prefill node {route.prefill.node_id} is unreachable", status=503)
        return req

    async def release(self, req: RouterRequest, reason: str = "client disconnected") -> None:
        """The HTTP side is done with `req`: if it has not ended, the client went away, so abort it."""
        if req.abort():
            self.metrics.observe_end(req, "abort")
            logger.info("aborting %s: %s", req.request_id, reason)
            await self._abort_nodes(req, reason)
        self._forget(req)

    # ---- control socket ----------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                await self._handle(frames)
            except MessageError as e:
                logger.warning("dropped a message from %r: %s", frames[0][:64], e)
            except Exception:  # a bug handling one message must not stop the router
                logger.exception("error handling a message from %r", frames[0][:64])

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise MessageError(f"expected one frame after the identity, got {len(frames) - 1}")
        identity, data = frames
        msg = decode(data)
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise MessageError(f"a {msg.TYPE} message is not for the router")
        await handler(identity, msg)

    async def _on_register(self, identity: bytes, msg: Register) -> None:
        if msg.role not in ROLES:
            raise MessageError(f"register: unknown role {msg.role!r}")
        if msg.model and msg.model != self.served_model_name:
            logger.warning("node %s serves %r, the router serves %r", msg.node_id, msg.model, self.served_model_name)
        old = self.registry.register(msg, identity)
        logger.info("node %s registered (role %s%s)", msg.node_id, msg.role, ", replacing" if old else "")
        if old is None:
            return
        if old.register.pid == msg.pid:  # the same process reconnected: its requests live on
            new = self.registry.nodes[msg.node_id]
            new.request_ids, new.outstanding_prompt_tokens = old.request_ids, old.outstanding_prompt_tokens
        else:
            await self._fail_node_requests(old, f"node {msg.node_id} restarted")

    async def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        if not self.registry.heartbeat(msg):
            logger.debug("heartbeat from unregistered node %s", msg.node_id)

    async def _on_deregister(self, identity: bytes, msg: Deregister) -> None:
        node = self.registry.remove(msg.node_id)
        if node is not None:
            logger.info("node %s deregistered", msg.node_id)
            await self._fail_node_requests(node, f"node {msg.node_id} left")

    async def _on_first_token(self, identity: bytes, msg: FirstToken) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            return  # aborted or ended already: a late token is expected, not an error
        self.registry.first_token(req.prefill_node_id, req.request_id)
        req.timing.prefill_queued_s, req.timing.prefill_s = msg.queued_s, msg.prefill_s
        req.timing.num_cached_tokens = msg.num_cached_tokens
        delivered_before = req.timing.first_token is not None  # a duplicate FirstToken is dropped
        await self._deliver(req, Token(msg.request_id, 0, msg.token_id, msg.logprobs, msg.finish_reason))
        if not delivered_before and req.timing.first_token is not None:
            self.metrics.observe_first_token(req)

    async def _on_token_batch(self, identity: bytes, msg: TokenBatch) -> None:
        for token in msg.tokens:
            req = self.requests.get(token.request_id)
            if req is not None:
                await self._deliver(req, token)

    async def _on_error(self, identity: bytes, msg: Error) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            return
        status, kind = (503, "ServiceUnavailableError") if msg.retryable else (500, "InternalServerError")
        await self._fail(req, RouterError(f"node {msg.node_id}: {msg.message}", status, kind))

    # ---- request outcomes --------------------------------------------------------------------
    async def _deliver(self, req: RouterRequest, token: Token) -> None:
        delta = req.receive(token)
        if delta is None:
            return
        req.deltas.put_nowait(delta)
        if req.status.is_done:
            self.metrics.observe_end(req, req.finish_reason)
            if req.stopped_by_router:  # the nodes would keep generating past the stop string
                await self._abort_nodes(req, "stop string")
            self._forget(req)

    async def _fail(self, req: RouterRequest, error: RouterError) -> None:
        delta = req.fail(error)
        if delta is None:
            return
        logger.warning("request %s failed: %s", req.request_id, error.message)
        self.metrics.observe_error(error.status)
        self.metrics.observe_end(req, None)
        req.deltas.put_nowait(delta)
        await self._abort_nodes(req, error.message)
        self._forget(req)

    async def _fail_node_requests(self, node: NodeInfo, reason: str) -> None:
        for request_id in list(node.request_ids):
            req = self.requests.get(request_id)
            if req is not None:
                await self._fail(req, RouterError(reason, 503, "ServiceUnavailableError"))

    async def _abort_nodes(self, req: RouterRequest, reason: str) -> None:
        for node_id in req.node_ids:
            node = self.registry.nodes.get(node_id)
            if node is not None:  # a dropped node holds nothing worth aborting
                await self._send(node, Abort(req.request_id, reason))

    def _forget(self, req: RouterRequest) -> None:
        self.requests.pop(req.request_id, None)
        self.registry.release_request(req.node_ids, req.request_id)

    async def _send(self, node: NodeInfo, msg: Message) -> bool:
        # NOBLOCK: a node that stopped reading must not stall the router; the send fails instead.
        try:
            await self._sock.send_multipart([node.identity, encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            logger.warning("cannot send %s to node %s: %s", msg.TYPE, node.node_id, e)
            return False

    async def _monitor_loop(self) -> None:
        interval = min(1.0, self.registry.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self._check_timeouts()
            except Exception:
                logger.exception("error checking timeouts")

    async def _check_timeouts(self) -> None:
        for node in self.registry.expire():
            logger.warning("node %s missed heartbeats for %.1f s: dropped", node.node_id,
                           self.registry.heartbeat_timeout_s)
            await self._fail_node_requests(node, f"node {node.node_id} stopped responding")
        now = time.monotonic()
        for req in list(self.requests.values()):
            if req.deadline is not None and now > req.deadline:
                await self._fail(req, RouterError("the request timed out", 504, "TimeoutError"))
