"""The router's control plane: the registry of live nodes, dispatch of requests to a (prefill,
decode) pair, and tokens flowing back to the HTTP side (router/app.py). `Router` is the one
object the HTTP side and the tests hold: it builds the parts below, wires each one's
collaborators into its constructor, and runs their loops.

    request_table.py  RequestTable: every request the router holds, by request id (in flight,
                      parked, n > 1 groups), and the node holdings derived from it
    dispatcher.py     Dispatcher: admission (429, 503), sending attempts, and a request's
                      outcomes (delivered tokens, failure, release, aborts on the nodes)
    redispatch.py     Redispatcher: re-dispatch of a request whose node died or whose KV transfer
                      failed, parking until a node is ready
    choices.py        ChoiceGroups: n > 1 requests, one prefill for n choices
    handlers.py       NodeMessages: one handler per node message, and the CURVE identity binding
    monitor.py        Monitor: the periodic checks (heartbeat expiry, deadlines, lost requests)
    control.py        ControlSocket: the ZMQ socket every node connects to
    saturation.py     Saturation, RetryAfter: the router's own load, and the 429s that shed new
                      requests while it lags
    disagg.py         PathPolicy: per request, prefill on a prefill node or on the decode node
                      (--disagg-policy, the cost model); speed.py fits each node's step time
    planner.py        Planner: the P:D split and pool sizes for the SLOs; planner_loop.py runs it
                      (--planner) and sends SetRole; scaling.py resizes pools

A request's life in the router: `parse` validates the body (4xx before any node sees it),
`submit` picks the nodes and sends PrefillRequest (429 + Retry-After when every ready node of a
role is past its queue limit, or when the router itself lags; 503 with no ready node at all),
tokens come back through the handlers into the request's outbox (`req.push`), and `release`
aborts it on the nodes if the client left before it ended. Failures (see "Failure handling" in
the README) end in a re-dispatch or an error delta in its outbox.

`self.metrics` (router/metrics.py) records a request's first token, its end, errors and retries,
and the peers the control socket refused (`pdserve_auth_refusals_total{reason}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
from collections.abc import Mapping

from pdserve.protocol.messages import SetRole
from pdserve.router.choices import ChoiceGroup, ChoiceGroups
from pdserve.router.control import ControlSocket
from pdserve.router.disagg import PathPolicy
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.handlers import NodeMessages
from pdserve.router.metrics import RouterMetrics
from pdserve.router.monitor import Monitor
from pdserve.router.openai_protocol import ParsedRequest, parse_chat, parse_completion
from pdserve.router.planner import Planner, WorkloadWindow
from pdserve.router.planner_loop import PlannerLoop
from pdserve.router.redispatch import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_WAIT_S, Redispatcher
from pdserve.router.registry import DEFAULT_MAX_QUEUE, Registry
from pdserve.router.request_state import RouterError, RouterRequest
from pdserve.router.request_table import Parked, RequestTable
from pdserve.router.saturation import DEFAULT_MAX_LAG_S, RetryAfter, Saturation

logger = logging.getLogger(__name__)


class Router:
    def __init__(self, tokenizer, served_model_name: str, *, control_addr: str = "tcp://127.0.0.1:0",
                 heartbeat_timeout_s: float = 5.0, prefix_affinity: bool = False,
                 request_timeout_s: float | None = 600.0, max_retries: int = DEFAULT_MAX_RETRIES,
                 max_queue: int = DEFAULT_MAX_QUEUE, lost_after_s: float | None = None,
                 retry_wait_s: float = DEFAULT_RETRY_WAIT_S,
                 curve=None, metrics: RouterMetrics | None = None,
                 max_lag_s: float | None = DEFAULT_MAX_LAG_S, path: PathPolicy | None = None,
                 planner: Planner | None = None, scaler=None) -> None:
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.curve = curve  # protocol.curve.CurveKeys: authenticate and encrypt the control socket
        self.metrics = metrics if metrics is not None else RouterMetrics()
        self.registry = Registry(heartbeat_timeout_s, prefix_affinity=prefix_affinity, max_queue=max_queue,
                                 path=path)
        self.table = RequestTable(self.registry)
        self.control = ControlSocket(control_addr, curve=curve, on_refused=self._on_auth_refused,
                                     on_token_batch=functools.partial(self.metrics.add_stage, "decode"))
        # max_lag_s: shed new requests (429) once the router itself lags this much (saturation.py)
        self.retry_after = RetryAfter()
        self.saturation = Saturation(self.control.backlog_age_s, max_lag_s=max_lag_s,
                                     on_lag=self.metrics.loop_lag.observe)
        self.dispatcher = Dispatcher(self.registry, self.table, self.control.send, self.metrics,
                                     saturation=self.saturation, retry_after=self.retry_after,
                                     request_timeout_s=request_timeout_s)
        self.redispatcher = Redispatcher(self.table, self.dispatcher, self.metrics, max_retries=max_retries,
                                         retry_wait_s=retry_wait_s)
        self.choices = ChoiceGroups(self.table, self.dispatcher, self.redispatcher, tokenizer)
        self.handlers = NodeMessages(served_model_name, self.registry, self.table, self.control, self.metrics,
                                     self.dispatcher, self.redispatcher, self.choices)
        lost_after_s = lost_after_s if lost_after_s is not None else 2 * heartbeat_timeout_s
        self.monitor = Monitor(self.registry, self.control, self.table, self.dispatcher, self.redispatcher,
                               lost_after_s=lost_after_s)
        self.metrics.watch(lambda: len(self.table),
                           lambda: [(n.role, n.ready) for n in self.registry.nodes.values()],
                           lambda: self.registry.kv_index.num_blocks)
        self.metrics.watch_saturation(self.saturation, self.control)
        self.planner: PlannerLoop | None = None  # --planner: role changes and pool sizes (planner_loop.py)
        if planner is not None:
            self.dispatcher.workload = WorkloadWindow(planner.config.window_s)
            self.planner = PlannerLoop(planner, self.registry, self.dispatcher.workload, self.dispatcher.send,
                                       scaler=scaler, metrics=self.metrics)
        self._tasks: list[asyncio.Task] = []

    @property
    def control_addr(self) -> str:
        """The bound control address ("" until started)."""
        return self.control.addr

    # ---- views of the parts' state, for the tests and the operator's eye --------------------------
    @property
    def requests(self) -> Mapping[str, RouterRequest]:
        """In flight (dispatched, not ended), by wire id; read-only."""
        return self.table.in_flight

    @property
    def parked(self) -> Mapping[str, Parked]:
        """Waiting for a node to re-dispatch to, by request id; read-only."""
        return self.table.parked

    @property
    def groups(self) -> Mapping[str, ChoiceGroup]:
        """n > 1 requests by request id, from submit to release; read-only."""
        return self.table.groups

    @property
    def node_keys(self) -> dict[str, str]:
        """CURVE only: node id → the z85 public key it registered with (handlers.py)."""
        return self.handlers.node_keys

    @property
    def retry_wait_s(self) -> float:
        return self.redispatcher.retry_wait_s

    @retry_wait_s.setter
    def retry_wait_s(self, seconds: float) -> None:
        self.redispatcher.retry_wait_s = seconds

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        # Everything alive now (the tokenizer, transformers and torch modules) stays alive: freezing
        # it keeps the cyclic GC from scanning it again in every full collection, which the
        # per-token allocations trigger often.
        gc.freeze()
        self.control.open()
        self._tasks = [asyncio.create_task(self.control.recv_loop(self.handlers.on_message)),
                       asyncio.create_task(self.control.monitor_loop()),
                       asyncio.create_task(self.monitor.loop()),
                       asyncio.create_task(self.saturation.probe_loop())]
        if self.planner is not None:
            self._tasks.append(asyncio.create_task(self.planner.run()))
        logger.info("router control socket bound at %s", self.control_addr)

    async def close(self) -> None:
        for req in list(self.table.requests()):
            await self.dispatcher.fail(req, RouterError("the router is shutting down", 503, "ServiceUnavailableError"))
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
        the router itself is saturated (saturation.py). n > 1: `submit_choices`."""
        deadline, route = self.dispatcher.admit(parsed)
        req = RouterRequest(request_id, parsed.prompt_token_ids, parsed.sampling, self.tokenizer, deadline=deadline)
        await self.redispatcher.start(req, route)
        return req

    async def submit_choices(self, request_id: str, parsed: ParsedRequest) -> ChoiceGroup:
        """`submit` for n > 1: one dispatch for every choice (choices.py)."""
        return await self.choices.submit(request_id, parsed)

    async def release(self, req: RouterRequest, reason: str = "client disconnected") -> None:
        """The HTTP side is done with `req`: if it has not ended, the client went away, so abort it."""
        await self.dispatcher.release(req, reason)

    async def set_role(self, node_id: str, role: str, reason: str = "asked over HTTP") -> str | None:
        """Ask node `node_id` to serve `role` (POST /nodes/{id}/role, or the planner). Returns
        None once SetRole is sent, else why not (the HTTP side answers 404 or 409)."""
        node = self.registry.nodes.get(node_id)
        if node is None:
            return f"no node {node_id!r} is registered"
        if node.role not in ("prefill", "decode"):
            return f"node {node_id} serves {node.role!r}: only prefill and decode nodes change role"
        if (node.changing_to or node.role) == role:
            return f"node {node_id} already serves {role}" + (" (changing)" if node.changing_to else "")
        others = [n for n in self.registry.nodes.values() if n is not node and n.ready]
        if role == "prefill" and not any((n.changing_to or n.role) in ("decode", "both") for n in others):
            return f"node {node_id} is the last decode node"
        if (role == "decode" and self.registry.path.policy == "always"
                and not any((n.changing_to or n.role) in ("prefill", "both") for n in others)):
            return f"node {node_id} is the last prefill node and --disagg-policy is always"
        node.changing_to = role
        if not await self.dispatcher.send(node, SetRole(role, reason)):
            node.changing_to = ""
            return f"node {node_id} cannot be reached"
        logger.info("node %s asked to serve %s: %s", node_id, role, reason)
        return None

    async def release_choices(self, group: ChoiceGroup, reason: str = "client disconnected") -> None:
        """`release` of every choice of `group` (choices.py)."""
        await self.choices.release(group, reason)
