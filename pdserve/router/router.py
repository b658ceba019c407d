"""The router's control plane: the registry of live nodes, dispatch of requests to a (prefill,
decode) pair, and tokens flowing back to the HTTP side (router/app.py). `Router` is the one
object the HTTP side and the tests hold; its parts live in one file per concept:

    control.py     the ZMQ control socket every node connects to: receive loop, sends, and the
                   table of what the router sends
    handlers.py    one handler per node message (Register, Heartbeat, Deregister, FirstToken,
                   TokenBatch, Error), with the table of what each does
    redispatch.py  re-dispatch of a request whose node died or whose KV transfer failed, parking
                   until a node is ready
    monitor.py     the periodic checks: heartbeat expiry, request deadlines, lost requests
    saturation.py  the router's own load: event-loop lag, control backlog, and the 429s that shed
                   new requests while it lags
    router.py      this file: lifecycle, the HTTP side's calls (parse, submit, release), and a
                   request's outcomes (delivered tokens, failure, aborts on the nodes)

A request's life in the router: `parse` validates the body (4xx before any node sees it),
`submit` picks the nodes and sends PrefillRequest (429 + Retry-After when every ready node of a
role is past its queue limit, or when the router itself lags: saturation.py; 503 with no ready
node at all), tokens come back through the
handlers into the request's outbox (`req.push`), and `release` aborts it on the nodes if the client left before it
ended. Failures (see "Failure handling" in the README) end in a re-dispatch (redispatch.py) or an
error delta in its outbox.

`self.metrics` (router/metrics.py) records a request's first token, its end, errors and retries,
and the peers the control socket refused (`pdserve_auth_refusals_total{reason}`).

With CURVE keys, `self.node_keys` binds each node id to the public key it first registered with,
for the router's lifetime (handlers.py has the rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time

from pdserve.protocol.messages import Abort, Message, PrefillRequest, Token
from pdserve.router.choices import ChoiceGroup, ParallelSampling
from pdserve.router.control import ControlSocket
from pdserve.router.handlers import NodeMessages
from pdserve.router.metrics import RouterMetrics
from pdserve.router.monitor import Monitor
from pdserve.router.openai_errors import ProtocolError
from pdserve.router.openai_protocol import ParsedRequest, parse_chat, parse_completion
from pdserve.router.redispatch import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_WAIT_S, Redispatch
from pdserve.router.registry import DEFAULT_MAX_QUEUE, NodeInfo, NoNodeError, OverloadedError, Registry, Route
from pdserve.router.request_state import Delta, RouterError, RouterRequest
from pdserve.router.saturation import DEFAULT_MAX_LAG_S, RetryAfter, Saturation

logger = logging.getLogger(__name__)


class Router(NodeMessages, Redispatch, Monitor, ParallelSampling):
    def __init__(self, tokenizer, served_model_name: str, *, control_addr: str = "tcp://127.0.0.1:0",
                 heartbeat_timeout_s: float = 5.0, prefix_affinity: bool = False,
                 request_timeout_s: float | None = 600.0, max_retries: int = DEFAULT_MAX_RETRIES,
                 max_queue: int = DEFAULT_MAX_QUEUE, lost_after_s: float | None = None,
                 retry_wait_s: float = DEFAULT_RETRY_WAIT_S,
                 curve=None, metrics: RouterMetrics | None = None,
                 max_lag_s: float | None = DEFAULT_MAX_LAG_S) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.registry = Registry(heartbeat_timeout_s, prefix_affinity=prefix_affinity, max_queue=max_queue)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s
        self.parked: dict[str, tuple[RouterRequest, float, str]] = {}  # request id → (req, wait until, why)
        self.groups: dict[str, ChoiceGroup] = {}  # n > 1 requests by request id (choices.py)
        self.lost_after_s = lost_after_s if lost_after_s is not None else 2 * heartbeat_timeout_s
        self.curve = curve  # protocol.curve.CurveKeys: authenticate and encrypt the control socket
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.control = ControlSocket(control_addr, curve=curve, on_refused=self._on_auth_refused,
                                     on_token_batch=functools.partial(self.metrics.add_stage, "decode"))
        self.requests: dict[str, RouterRequest] = {}  # in flight (dispatched, not ended), by wire id
        self._reregister_sent: dict[str, float] = {}  # node id → when we last asked it to register
        self.node_keys: dict[str, str] = {}  # CURVE only: node id → the z85 public key it registered with
        self._taken_logged: set[tuple[str, str]] = set()  # (node id, key) refusals already logged
        self.metrics.watch(lambda: len(self.requests) + len(self.parked),
                           lambda: [(n.role, n.ready) for n in self.registry.nodes.values()])
        # max_lag_s: shed new requests (429) once the router itself lags this much (saturation.py)
        self.retry_after = RetryAfter()  # the Retry-After of a 429 (saturation.py)
        self.saturation = Saturation(self.control.backlog_age_s, max_lag_s=max_lag_s,
                                     on_lag=self.metrics.loop_lag.observe)
        self.metrics.watch_saturation(self.saturation, self.control)
        self._tasks: list[asyncio.Task] = []

    @property
    def control_addr(self) -> str:
        """The bound control address ("" until started)."""
        return self.control.addr

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        # Everything alive now (the tokenizer, transformers and torch modules: ~300k objects) stays
        # alive: freezing it keeps the cyclic GC from scanning it again in every full collection,
        # which the per-token allocations trigger often (a third of the router's time per token).
        gc.freeze()
        self.control.open()
        self._tasks = [asyncio.create_task(self.control.recv_loop(self._on_message)),
                       asyncio.create_task(self.control.monitor_loop()),
                       asyncio.create_task(self._monitor_loop()),
                       asyncio.create_task(self.saturation.probe_loop())]
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
        self.control.close()
        gc.unfreeze()  # a process that goes on (tests) gets its garbage collected again

    def _on_auth_refused(self, reason: str, peer: str) -> None:
        """The control socket refused a peer (any thread: the ZAP callback runs in its own)."""
        self.metrics.observe_auth_refusal(reason)

    def is_healthy(self) -> bool:
        return self.registry.is_healthy()

    # ---- requests (called by the HTTP side) ----------------------------------------------
    def parse(self, kind: str, body) -> ParsedRequest:
        """Validate an OpenAI body; raises ProtocolError (4xx)."""
        parse = parse_chat if kind == "chat" else parse_completion
        return parse(body, self.tokenizer, self.served_model_name, self.registry.max_model_len())

    async def submit(self, request_id: str, parsed: ParsedRequest) -> RouterRequest:
        """Pick the nodes and send the PrefillRequest. Raises ProtocolError: 503 when no node can
        take it, 429 (with Retry-After) when every node of a role is past its queue limit or when
        the router itself is saturated (saturation.py). n > 1: `submit_choices` (choices.py)."""
        deadline, route = self._admit(parsed)
        req = RouterRequest(request_id, parsed.prompt_token_ids, parsed.sampling, self.tokenizer, deadline=deadline)
        if not await self._dispatch(req, route):  # a failure ends up in req's outbox, like any other
            await self._redispatch(req, f"prefill node {route.prefill.node_id} is unreachable")
        return req

    def _admit(self, parsed: ParsedRequest) -> tuple[float | None, Route]:
        """The checks before a new request is sent anywhere: (its deadline, its nodes)."""
        shed = self.saturation.admit(len(self.requests) + len(self.parked))
        if shed is not None:
            self.metrics.observe_shed(shed)
            raise self._too_many(f"the router is overloaded ({shed.replace('_', ' ')}); retry later")
        deadline = time.monotonic() + self.request_timeout_s if self.request_timeout_s else None
        try:
            route = self.registry.route(parsed.prompt_token_ids, parsed.sampling.max_tokens)
        except NoNodeError as e:
            raise ProtocolError(f"no ready {e} node is registered", status=503) from None
        except OverloadedError as e:
            raise self._too_many(f"every {e} node is at its queue limit; retry later") from None
        self.retry_after.admitted()
        return deadline, route

    def _too_many(self, message: str) -> ProtocolError:
        """A 429 whose Retry-After books the client's retry (saturation.py: RetryAfter)."""
        return ProtocolError(message, status=429, headers={"Retry-After": str(self.retry_after.rejected())})

    async def release(self, req: RouterRequest, reason: str = "client disconnected") -> None:
        """The HTTP side is done with `req`: if it has not ended, the client went away, so abort it."""
        if req.abort():
            self.metrics.observe_end(req, "abort")
            logger.info("aborting %s: %s", req.request_id, reason)
            await self._abort_nodes(req, reason)
        self._forget(req)

    # ---- a request's attempts and outcomes --------------------------------------------------
    async def _dispatch(self, req: RouterRequest, route: Route) -> bool:
        """Send the current attempt to `route`; False when the prefill node cannot be reached."""
        prompt, sampling = req.attempt_prompt_ids, req.attempt_sampling
        req.mark_dispatched(route.prefill.node_id, route.decode.node_id if route.decode else "")
        self.requests[req.wire_id] = req
        self.registry.add_request(route, req.wire_id, len(prompt), sampling.max_tokens)
        msg = PrefillRequest(req.wire_id, prompt, sampling.to_dict(), req.decode_node_id,
                             route.decode.register.kv_addr if route.decode else "",
                             arrival_time=req.timing.arrival_wall, num_prior_output_tokens=req.index_offset)
        return await self._send(route.prefill, msg)

    async def _deliver(self, req: RouterRequest, token: Token) -> None:
        delta = req.receive(token)
        if delta is not None:
            await self._delivered(req, delta)

    async def _delivered(self, req: RouterRequest, delta: Delta) -> None:
        """`req`'s output grew by `delta`: hand it to the HTTP side, and end the request if it ended."""
        req.push(delta)
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
        req.push(delta)
        await self._abort_nodes(req, error.message)
        self._forget(req)

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
        return await self.control.send(node.identity, node.node_id, msg)
