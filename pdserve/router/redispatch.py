"""Re-dispatch and parking: what the router does when a request's current attempt is lost.

A node is lost when it misses heartbeats for `heartbeat_timeout_s` (monitor.py), when it comes
back with another pid, or when it deregisters still holding requests (handlers.py). Each request
it held whose current attempt depends on it (it is the decode node, or the prefill node before
the first token) is re-dispatched: a new attempt (request_state.py) with the prompt plus every
token streamed so far, on live nodes (queue limits ignored: the client is already waiting), up
to `max_retries` times; then the client gets an error. A retryable Error from a node (a KV
transfer failed, a node is full) and a request no node lists any more (monitor.py) take the
same path.

    start       dispatch an attempt; an unreachable prefill node makes it a lost attempt
    redispatch  abort what is left of the attempt, start the next one, or fail past max_retries
    park        no live node can take the next attempt: hold it (its stream pauses)...
    unpark      ...until a node is ready (heartbeats and the monitor call it), for at most
                `retry_wait_s`, or the request's deadline; then the client gets a 503
"""

from __future__ import annotations

import logging
import time

from pdserve.router.dispatcher import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import NodeInfo, NoNodeError, Route
from pdserve.router.request_state import RouterError, RouterRequest
from pdserve.router.request_table import RequestTable

logger = logging.getLogger(__name__)

DEFAULT_MAX_RETRIES = 3
DEFAULT_RETRY_WAIT_S = 30.0  # how long a re-dispatch waits for a ready node before the request fails


class Redispatcher:
    def __init__(self, table: RequestTable, dispatcher: Dispatcher, metrics: RouterMetrics, *,
                 max_retries: int = DEFAULT_MAX_RETRIES, retry_wait_s: float = DEFAULT_RETRY_WAIT_S) -> None:
        self.table = table
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s

    async def start(self, req: RouterRequest, route: Route) -> None:
        """Dispatch `req`'s current attempt to `route`; when the prefill node cannot be reached the
        attempt is lost like any other (a failure ends up in req's outbox)."""
        if not await self.dispatcher.dispatch(req, route):
            await self.redispatch(req, f"prefill node {route.prefill.node_id} is unreachable")

    async def node_lost(self, node: NodeInfo, reason: str) -> None:
        """`node` is gone (dead, restarted, left): re-dispatch every request whose current attempt
        needs it. A prefill node is no longer needed once the attempt's first token is out: the KV
        went to the decode node (if that hand-off fails, the decode node reports it)."""
        for wire_id in list(node.request_ids):
            req = self.table.attempt(wire_id)
            if req is None:
                continue
            if node.node_id == req.decode_node_id or not req.decode_node_id or not req.attempt_started:
                await self.redispatch(req, reason)

    async def redispatch(self, req: RouterRequest, reason: str) -> None:
        """The current attempt is lost (a node died, a transfer failed): abort what is left of it
        on live nodes and start the next attempt elsewhere (parked until a node is ready, when
        none is), or fail the request past max_retries."""
        while not req.status.is_done:
            self.table.forget(req)  # first, without awaiting: a later message about this attempt finds nothing
            await self.dispatcher.abort_nodes(req, reason)
            if req.attempt >= self.max_retries:
                await self.dispatcher.fail(req, RouterError(f"{reason}; gave up after {req.attempt} retries", 503,
                                                            "ServiceUnavailableError"))
                return
            req.next_attempt()
            self.metrics.observe_retry()
            logger.warning("re-dispatching %s as %s (%d tokens streamed): %s", req.request_id, req.wire_id,
                           req.index_offset, reason)
            try:
                route = self.dispatcher.reroute(req)
            except NoNodeError as e:
                await self.park(req, f"{reason}; no ready {e} node to retry on")
                return
            if await self.dispatcher.dispatch(req, route):
                return
            reason = f"prefill node {route.prefill.node_id} is unreachable"

    async def park(self, req: RouterRequest, reason: str) -> None:
        """No node can take the next attempt now: hold it (its stream just pauses) until one is
        ready, for at most `retry_wait_s` (a restarting node takes a few seconds)."""
        if self.retry_wait_s <= 0:
            await self.dispatcher.fail(req, RouterError(reason, 503, "ServiceUnavailableError"))
            return
        logger.warning("parking %s for up to %g s: %s", req.request_id, self.retry_wait_s, reason)
        self.table.park(req, time.monotonic() + self.retry_wait_s, reason)

    async def unpark(self) -> None:
        """Dispatch parked requests to nodes that became ready; fail those that waited too long."""
        now = time.monotonic()
        for request_id in list(self.table.parked):
            parked = self.table.parked.get(request_id)  # another caller may have taken it while we awaited
            if parked is None:
                continue
            req = parked.req
            try:
                route = None if req.status.is_done else self.dispatcher.reroute(req)
            except NoNodeError:
                if now > parked.wait_until or (req.deadline is not None and now > req.deadline):
                    self.table.unpark(request_id)
                    await self.dispatcher.fail(req, RouterError(f"{parked.reason} (waited {self.retry_wait_s:g} s)",
                                                                503, "ServiceUnavailableError"))
                continue
            self.table.unpark(request_id)
            if route is not None:
                await self.start(req, route)
