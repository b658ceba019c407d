"""Re-dispatch and parking: what the router does when a request's current attempt is lost.

A node is lost when it misses heartbeats for `heartbeat_timeout_s` (monitor.py), when it comes
back with another pid, or when it deregisters still holding requests (handlers.py). Each request
it held whose current attempt depends on it (it is the decode node, or the prefill node before
the first token) is re-dispatched: a new attempt (request_state.py) with the prompt plus every
token streamed so far, on live nodes (queue limits ignored: the client is already waiting), up
to `max_retries` times; then the client gets an error. A retryable Error from a node (a KV
transfer failed, a node is full) and a request no node lists any more (monitor.py) take the
same path.

    _redispatch  abort what is left of the attempt, start the next one, or fail past max_retries
    _park        no live node can take the next attempt: hold it (its stream pauses)...
    _unpark      ...until a node is ready (heartbeats and the monitor call it), for at most
                 `retry_wait_s`, or the request's deadline; then the client gets a 503

`Redispatch` is one part of `Router` (router.py).
"""

from __future__ import annotations

import logging
import time

from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import NodeInfo, NoNodeError, Registry, Route
from pdserve.router.request_state import RouterError, RouterRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_RETRIES = 3
DEFAULT_RETRY_WAIT_S = 30.0  # how long a re-dispatch waits for a ready node before the request fails


class Redispatch:
    """Mixed into `Router`, whose state it uses (below) and whose `_dispatch`, `_fail`,
    `_abort_nodes` and `_forget` it calls."""

    registry: Registry
    requests: dict[str, RouterRequest]
    parked: dict[str, tuple[RouterRequest, float, str]]  # request id → (req, wait until, why)
    metrics: RouterMetrics
    max_retries: int
    retry_wait_s: float

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

    def _reroute(self, req: RouterRequest) -> Route:
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
