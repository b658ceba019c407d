"""Sending requests to nodes and ending them: the router's side of a request's attempts.

    admit         the checks before a new request is sent anywhere: the router's own load
                  (saturation.py: 429), a ready node of each role (503), the nodes' queue limits
                  (429 + Retry-After); returns its deadline and its nodes
    dispatch      send the current attempt as a PrefillRequest, in flight in the request table
    delivered     the request's output grew: push the delta to the HTTP side, end it if it ended
    fail          end it with an error delta (its nodes get Abort)
    release       the HTTP side is done with it: abort it on the nodes if it had not ended
    abort_nodes   send Abort for the current attempt to each live node that may hold it

Every way a request ends goes through `RequestTable.forget`, here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from pdserve.protocol.messages import Abort, Message, PrefillRequest, Token
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_errors import ProtocolError
from pdserve.router.openai_protocol import ParsedRequest
from pdserve.router.planner import WorkloadWindow
from pdserve.router.registry import NodeInfo, NoNodeError, OverloadedError, Registry, Route
from pdserve.router.request_state import Delta, RouterError, RouterRequest
from pdserve.router.request_table import RequestTable
from pdserve.router.saturation import RetryAfter, Saturation

logger = logging.getLogger(__name__)

Send = Callable[[bytes, str, Message], Awaitable[bool]]  # ControlSocket.send: (routing id, node id, msg)


class Dispatcher:
    def __init__(self, registry: Registry, table: RequestTable, send: Send, metrics: RouterMetrics, *,
                 saturation: Saturation, retry_after: RetryAfter, request_timeout_s: float | None) -> None:
        self.registry = registry
        self.table = table
        self._send_to = send
        self.metrics = metrics
        self.saturation = saturation
        self.retry_after = retry_after  # the Retry-After of a 429
        self.request_timeout_s = request_timeout_s
        self.workload: WorkloadWindow | None = None  # the planner's window (planner_loop.py), when it runs

    # ---- before a request is sent -------------------------------------------------------------
    def admit(self, parsed: ParsedRequest) -> tuple[float | None, Route]:
        """The checks before a new request is sent anywhere: (its deadline, its nodes). Raises
        ProtocolError: 503 when no node can take it, 429 (with Retry-After) when every node of a
        role is past its queue limit or when the router itself is saturated."""
        shed = self.saturation.admit(len(self.table))
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
        self.metrics.observe_path(route)
        if self.workload is not None:
            self.workload.arrival(time.monotonic(), len(parsed.prompt_token_ids), parsed.sampling.max_tokens)
        return deadline, route

    def _too_many(self, message: str) -> ProtocolError:
        """A 429 whose Retry-After books the client's retry (saturation.py: RetryAfter)."""
        return ProtocolError(message, status=429, headers={"Retry-After": str(self.retry_after.rejected())})

    def reroute(self, req: RouterRequest) -> Route:
        """Nodes for a re-dispatched attempt (queue limits ignored: it is already streaming);
        raises NoNodeError."""
        route = self.registry.route(req.attempt_prompt_ids, req.attempt_sampling.max_tokens, ignore_limits=True)
        self.metrics.observe_path(route)
        return route

    # ---- sending --------------------------------------------------------------------------------
    async def dispatch(self, req: RouterRequest, route: Route) -> bool:
        """Send the current attempt to `route`; False when the prefill node cannot be reached."""
        prompt, sampling = req.attempt_prompt_ids, req.attempt_sampling
        self.table.dispatched(req, route, len(prompt))
        msg = PrefillRequest(req.wire_id, prompt, sampling.to_dict(), req.decode_node_id,
                             route.decode.register.kv_addr if route.decode else "",
                             arrival_time=req.timing.arrival_wall, num_prior_output_tokens=req.index_offset)
        return await self.send(route.prefill, msg)

    async def send(self, node: NodeInfo, msg: Message) -> bool:
        return await self._send_to(node.identity, node.node_id, msg)

    async def abort_nodes(self, req: RouterRequest, reason: str) -> None:
        await self.abort_on(req.node_ids, req.wire_id, reason)

    async def abort_on(self, node_ids: list[str], wire_id: str, reason: str) -> None:
        """Abort `wire_id` on each of `node_ids` still live (a dropped node holds nothing worth aborting)."""
        for node_id in node_ids:
            node = self.registry.nodes.get(node_id)
            if node is not None:
                await self.send(node, Abort(wire_id, reason))

    # ---- outcomes -------------------------------------------------------------------------------
    async def deliver(self, req: RouterRequest, token: Token) -> None:
        delta = req.receive(token)
        if delta is not None:
            await self.delivered(req, delta)

    async def delivered(self, req: RouterRequest, delta: Delta) -> None:
        """`req`'s output grew by `delta`: hand it to the HTTP side, and end the request if it ended."""
        req.push(delta)
        if req.status.is_done:
            self.metrics.observe_end(req, req.finish_reason)
            if self.workload is not None:
                self.workload.end(time.monotonic(), len(req.output_token_ids))
            if req.stopped_by_router:  # the nodes would keep generating past the stop string
                await self.abort_nodes(req, "stop string")
            self.table.forget(req)

    async def fail(self, req: RouterRequest, error: RouterError) -> None:
        delta = req.fail(error)
        if delta is None:
            return
        logger.warning("request %s failed: %s", req.request_id, error.message)
        self.metrics.observe_error(error.status)
        self.metrics.observe_end(req, None)
        req.push(delta)
        await self.abort_nodes(req, error.message)
        self.table.forget(req)

    async def release(self, req: RouterRequest, reason: str = "client disconnected") -> None:
        """The HTTP side is done with `req`: if it has not ended, the client went away, so abort it."""
        if req.abort():
            self.metrics.observe_end(req, "abort")
            logger.info("aborting %s: %s", req.request_id, reason)
            await self.abort_nodes(req, reason)
        self.table.forget(req)
