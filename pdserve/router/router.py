"""The router's control plane: one ZMQ ROUTER socket that every node connects to, the registry of
live nodes, dispatch of requests to a (prefill, decode) pair, and tokens flowing back to HTTP.

Each ZMQ message is [identity, kvtransfer.messages.encode(msg)]; nodes connect DEALER sockets
whose identity is their node_id. What the router does with each message:

    Register    add the node (replace an entry with the same node_id; if its pid changed the old
                process is gone, so its requests are re-dispatched). Eligible once a heartbeat says ready.
    Heartbeat   refresh liveness and load (free blocks, outstanding prompt tokens, ready), and
                reconcile: a request the node lists that the router does not place there is
                aborted on it; a heartbeat from a node the router does not know gets Reregister
    Deregister  drop the node (it drained first); anything it still held is re-dispatched
    FirstToken  output index 0 of a request: ends the prompt-token accounting on the prefill node
    TokenBatch  tokens with index >= 1; a token with finish_reason ends the request
    Error       retryable (a KV transfer failed, a node is full): the request is re-dispatched;
                otherwise it fails (500, or an error event once streaming)
    anything else, garbage, wrong frame count: logged and dropped

and what it sends:

    PrefillRequest  to the chosen prefill node, naming the decode node ("" = decode it yourself)
    Abort           to every live node holding the request, when the client goes away, when a
                    stop string ends it, when its deadline passes, when it is re-dispatched,
                    and when a heartbeat lists a request the router does not place on that node
    Reregister      to a node whose heartbeat the router does not recognise

Failures and re-dispatch (see "Failure handling" in the README). A node is dead when it misses
heartbeats for `heartbeat_timeout_s`, when it comes back with another pid, or when it
deregisters still holding requests. Each request it held whose current attempt depends on it
(it is the decode node, or the prefill node before the first token) is re-dispatched: a new
attempt (request_state.py) with the prompt plus every token streamed so far, on live nodes,
up to `max_retries` times; then the client gets an error. A request that no live node has listed
in its heartbeats for `lost_after_s` (a message lost with a dying node) is re-dispatched too.
When no node can take a re-dispatch, the request is parked (its stream pauses) until one is ready,
for at most `retry_wait_s`. When every ready node of a role is past its queue limit, a new
request gets 429 + Retry-After; with no ready node at all, 503.

`self.metrics` (router/metrics.py) records a request's first token, its end, errors and retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from pdserve.kvtransfer.messages import (
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
    Reregister,
    Token,
    TokenBatch,
    decode,
    encode,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import ParsedRequest, ProtocolError, parse_chat, parse_completion
from pdserve.router.registry import DEFAULT_MAX_QUEUE, NodeInfo, NoNodeError, OverloadedError, Registry
from pdserve.router.request_state import RouterError, RouterRequest

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")
DEFAULT_MAX_RETRIES = 3
DEFAULT_RETRY_WAIT_S = 30.0  # how long a re-dispatch waits for a ready node before the request fails
RETRY_AFTER_S = 1  # the Retry-After of a 429


class Router:
    def __init__(self, tokenizer, served_model_name: str, *, control_addr: str = "tcp://127.0.0.1:0",
                 heartbeat_timeout_s: float = 5.0, prefix_affinity: bool = False,
                 request_timeout_s: float | None = 600.0, max_retries: int = DEFAULT_MAX_RETRIES,
                 max_queue: int = DEFAULT_MAX_QUEUE, lost_after_s: float | None = None,
                 retry_wait_s: float = DEFAULT_RETRY_WAIT_S,
                 curve=None, metrics: RouterMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.registry = Registry(heartbeat_timeout_s, prefix_affinity=prefix_affinity, max_queue=max_queue)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s
        self.parked: dict[str, tuple[RouterRequest, float, str]] = {}  # request id → (req, wait until, why)
        self.lost_after_s = lost_after_s if lost_after_s is not None else 2 * heartbeat_timeout_s
        self.curve = curve  # kvtransfer.curve.CurveKeys: authenticate and encrypt the control socket
        self.requests: dict[str, RouterRequest] = {}  # in flight (dispatched, not ended), by wire id
        self._reregister_sent: dict[str, float] = {}  # node id → when we last asked it to register
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.metrics.watch(lambda: len(self.requests) + len(self.parked),
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
        if self.curve is not None:  # only nodes holding the cluster's keys get in (kvtransfer/curve.py)
            from pdserve.kvtransfer.curve import apply_server

            apply_server(sock, self.curve)
        sock.bind(self._bind_addr)
        self._sock = sock
        self.control_addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._monitor_loop())]
        logger.info("router control socket bound at %s", self.control_addr)

    async def close(self) -> None:
        for req in [*self.requests.values(), *(p[0] for p in self.parked.values())]:
            await self._fail(req, RouterError("the router is shutting down", 503, "ServiceUnavailableError"))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sock is not None:
            self._sock.close(linger=0)
            if self.curve is not None:
                from pdserve.kvtransfer.curve import stop_authenticator

                stop_authenticator(self._ctx)  # before term(), which would wait for it forever
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
        """Pick the nodes and send the PrefillRequest. Raises ProtocolError: 503 when no node can
        take it, 429 (with Retry-After) when every node of a role is past its queue limit."""
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s else None
        req = RouterRequest(request_id, parsed.prompt_token_ids, parsed.sampling, self.tokenizer, deadline=deadline)
        try:
            route = self.registry.route(req.prompt_token_ids, req.sampling.max_tokens)
        except NoNodeError as e:
            raise ProtocolError(f"no ready {e} node is registered", status=503) from None
        except OverloadedError as e:
            raise ProtocolError(f"every {e} node is at its queue limit; retry later", status=429,
                                headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        if not await self._dispatch(req, route):  # a failure ends up in req.deltas, like any other
            await self._redispatch(req, f"prefill node {route.prefill.node_id} is unreachable")
        return req

    async def release(self, req: RouterRequest, reason: str = "client disconnected") -> None:
        """The HTTP side is done with `req`: if it has not ended, the client went away, so abort it."""
        if req.abort():
            self.metrics.observe_end(req, "abort")
            logger.info("aborting %s: %s", req.request_id, reason)
            await self._abort_nodes(req, reason)
        self._forget(req)

    async def _dispatch(self, req: RouterRequest, route) -> bool:
        """Send the current attempt to `route`; False when the prefill node cannot be reached."""
        prompt, sampling = req.attempt_prompt_ids, req.attempt_sampling
        req.mark_dispatched(route.prefill.node_id, route.decode.node_id if route.decode else "")
        self.requests[req.wire_id] = req
        self.registry.add_request(route, req.wire_id, len(prompt), sampling.max_tokens)
        msg = PrefillRequest(req.wire_id, prompt, sampling.to_dict(), req.decode_node_id,
                             route.decode.register.kv_addr if route.decode else "",
                             arrival_time=req.timing.arrival_wall, num_prior_output_tokens=req.index_offset)
        return await self._send(route.prefill, msg)

    async def _redispatch(self, req: RouterRequest, reason: str) -> None:
        """The current attempt is lost (a node died, a transfer failed): abort what is left of it
        on live nodes and start the next attempt elsewhere (parked until a node is ready, when
        none is), or fail the request past max_retries."""
        while not req.status.is_done:
            self._forget(req)  # first, without awaiting: a later message about this attempt finds nothing
            await self._abort_nodes(req, reason)
            if req.attempt >= self.max_retries:
                await self._fail(req, RouterError(f"{reason}; gave up after {req.attempt} retries", 503,
                                                  "ServiceUnavailableError"))
                return
            req.next_attempt()
            self.metrics.observe_retry()
            logger.warning("re-dispatching %s as %s (%d tokens streamed): %s", req.request_id, req.wire_id,
                           req.index_offset, reason)
            try:
                route = self._reroute(req)
            except NoNodeError as e:
                await self._park(req, f"{reason}; no ready {e} node to retry on")
                return
            if await self._dispatch(req, route):
                return
            reason = f"prefill node {route.prefill.node_id} is unreachable"

    def _reroute(self, req: RouterRequest):
        """Nodes for a re-dispatched attempt (queue limits ignored: it is already streaming)."""
        return self.registry.route(req.attempt_prompt_ids, req.attempt_sampling.max_tokens, ignore_limits=True)

    async def _park(self, req: RouterRequest, reason: str) -> None:
        """No node can take the next attempt now: hold it (its stream just pauses) until one is
        ready, for at most `retry_wait_s` (a restarting node takes a few seconds)."""
        if self.retry_wait_s <= 0:
            await self._fail(req, RouterError(reason, 503, "ServiceUnavailableError"))
            return
        logger.warning("parking %s for up to %g s: %s", req.request_id, self.retry_wait_s, reason)
        self.parked[req.request_id] = (req, time.monotonic() + self.retry_wait_s, reason)

    async def _unpark(self) -> None:
        """Dispatch parked requests to nodes that became ready; fail those that waited too long."""
        now = time.monotonic()
        for request_id in list(self.parked):
            entry = self.parked.get(request_id)  # another caller may have taken it while we awaited
            if entry is None:
                continue
            req, wait_until, reason = entry
            try:
                route = None if req.status.is_done else self._reroute(req)
            except NoNodeError:
                if now > wait_until or (req.deadline is not None and now > req.deadline):
                    del self.parked[request_id]
                    await self._fail(req, RouterError(f"{reason} (waited {self.retry_wait_s:g} s)", 503,
                                                      "ServiceUnavailableError"))
                continue
            del self.parked[request_id]
            if route is not None and not await self._dispatch(req, route):
                await self._redispatch(req, f"prefill node {route.prefill.node_id} is unreachable")

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
        self._reregister_sent.pop(msg.node_id, None)
        logger.info("node %s registered (role %s, pid %d%s)", msg.node_id, msg.role, msg.pid,
                    ", replacing" if old else "")
        if old is None:
            return
        if old.register.pid == msg.pid:  # the same process reconnected: its requests live on
            new = self.registry.nodes[msg.node_id]
            new.request_ids, new.outstanding_prompt_tokens = old.request_ids, old.outstanding_prompt_tokens
        else:
            await self._node_lost(old, f"node {msg.node_id} restarted")

    async def _on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        node = self.registry.nodes.get(msg.node_id)
        if node is None:
            await self._ask_to_register(msg.node_id)
            return
        self.registry.heartbeat(msg)
        if self.parked and node.ready:
            await self._unpark()
        now = time.monotonic()
        for wire_id in msg.request_ids:
            req = self.requests.get(wire_id)
            if req is not None and wire_id in node.request_ids:
                req.last_listed = now
            elif req is None or node.node_id not in req.node_ids:
                # Ended, re-dispatched, or from before a router restart: nobody wants its tokens.
                await self._send(node, Abort(wire_id, "unknown to the router"))

    async def _ask_to_register(self, node_id: str) -> None:
        """A heartbeat from a node the router does not know: it was dropped (missed heartbeats) or
        the router restarted. Ask it to register again (at most once per heartbeat timeout)."""
        now = time.monotonic()
        if now - self._reregister_sent.get(node_id, -1e9) < self.registry.heartbeat_timeout_s:
            return
        self._reregister_sent[node_id] = now
        logger.info("heartbeat from unknown node %s: asking it to register", node_id)
        # By convention a node's main socket has its id as identity. If it is not connected (yet),
        # the send fails and a later heartbeat asks again.
        await self._send_to(node_id.encode(), node_id, Reregister("unknown node"), log_level=logging.INFO)

    async def _on_deregister(self, identity: bytes, msg: Deregister) -> None:
        node = self.registry.remove(msg.node_id)
        if node is not None:
            logger.info("node %s deregistered", msg.node_id)
            await self._node_lost(node, f"node {msg.node_id} left")

    async def _on_first_token(self, identity: bytes, msg: FirstToken) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            return  # aborted or ended already: a late token is expected, not an error
        self.registry.first_token(req.prefill_node_id, req.wire_id)
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
        if req is None or msg.node_id not in req.node_ids:
            return  # an earlier attempt's, or a stranger's
        if msg.retryable:
            await self._redispatch(req, f"node {msg.node_id}: {msg.message}")
        else:
            await self._fail(req, RouterError(f"node {msg.node_id}: {msg.message}", 500, "InternalServerError"))

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

    async def _node_lost(self, node: NodeInfo, reason: str) -> None:
        """`node` is gone (dead, restarted, left): re-dispatch every request whose current attempt
        needs it. A prefill node is no longer needed once the attempt's first token is out: the KV
        went to the decode node (if that hand-off fails, the decode node reports it)."""
        for wire_id in list(node.request_ids):
            req = self.requests.get(wire_id)
            if req is None:
                continue
            if node.node_id == req.decode_node_id or not req.decode_node_id or not req.attempt_started:
                await self._redispatch(req, reason)

    async def _abort_nodes(self, req: RouterRequest, reason: str) -> None:
        for node_id in req.node_ids:
            node = self.registry.nodes.get(node_id)
            if node is not None:  # a dropped node holds nothing worth aborting
                await self._send(node, Abort(req.wire_id, reason))

    def _forget(self, req: RouterRequest) -> None:
        self.parked.pop(req.request_id, None)
        if self.requests.get(req.wire_id) is req:
            del self.requests[req.wire_id]
        self.registry.release_request(req.node_ids, req.wire_id)

    async def _send(self, node: NodeInfo, msg: Message) -> bool:
        return await self._send_to(node.identity, node.node_id, msg)

    async def _send_to(self, identity: bytes, node_id: str, msg: Message, log_level: int = logging.WARNING) -> bool:
        # NOBLOCK: a node that stopped reading must not stall the router; the send fails instead.
        try:
            data = encode(msg)
        except (ValueError, TypeError, OverflowError) as e:  # a value msgpack cannot carry
            logger.error("cannot encode %s for node %s: %s", msg.TYPE, node_id, e)
            return False
        try:
            await self._sock.send_multipart([identity, data], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            logger.log(log_level, "cannot send %s to node %s: %s", msg.TYPE, node_id, e)
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
            await self._node_lost(node, f"node {node.node_id} stopped responding")
        if self.parked:
            await self._unpark()
        now = time.monotonic()
        for req in list(self.requests.values()):
            if req.status.is_done:
                continue
            if req.deadline is not None and now > req.deadline:
                await self._fail(req, RouterError("the request timed out", 504, "TimeoutError"))
            elif now - req.last_listed > self.lost_after_s:
                await self._redispatch(req, f"no node has listed {req.wire_id} for {self.lost_after_s:g} s")
