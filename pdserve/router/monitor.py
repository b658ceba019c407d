"""The router's periodic checks, every min(1 s, heartbeat_timeout_s / 4):

    heartbeat expiry   a node silent for `heartbeat_timeout_s` is dropped and its requests are
                       re-dispatched (redispatch.py); silent as far as the router can tell: up to
                       what it has handled (a heartbeat may wait behind a backlog, or in the socket
                       through a stall of the event loop), so a router that falls behind does not
                       drop healthy nodes
    parked requests    re-dispatched once a node is ready, failed past `retry_wait_s` (redispatch.py)
    deadlines          a request past its deadline (`request_timeout_s`) fails with a 504 and is
                       aborted on its nodes
    lost requests      a request that no node has listed in its heartbeats for `lost_after_s` (a
                       message lost with a dying node) is re-dispatched; silent up to the same point
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdserve.router.control import ControlSocket
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.redispatch import Redispatcher
from pdserve.router.registry import Registry
from pdserve.router.request_state import RouterError
from pdserve.router.request_table import RequestTable

logger = logging.getLogger(__name__)


class Monitor:
    """The periodic checks above, on the registry, the control socket and the request table."""

    def __init__(self, registry: Registry, control: ControlSocket, table: RequestTable, dispatcher: Dispatcher,
                 redispatcher: Redispatcher, *, lost_after_s: float) -> None:
        self.registry = registry
        self.control = control
        self.table = table
        self.dispatcher = dispatcher
        self.redispatcher = redispatcher
        self.lost_after_s = lost_after_s

    async def loop(self) -> None:
        interval = min(1.0, self.registry.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check()
            except Exception:
                logger.exception("error checking timeouts")

    async def check(self) -> None:
        await self.expire_nodes()
        if self.table.parked:
            await self.redispatcher.unpark()
        await self.check_requests()

    async def expire_nodes(self) -> None:
        # Silence is judged up to what the router has handled (ControlSocket.known_until), not up
        # to now: a router that lags behind its backlog would blame the nodes for its own delay.
        for node in self.registry.expire(now=self.control.known_until()):
            logger.warning("node %s missed heartbeats for %.1f s: dropped", node.node_id,
                           self.registry.heartbeat_timeout_s)
            await self.redispatcher.node_lost(node, f"node {node.node_id} stopped responding")

    async def check_requests(self) -> None:
        """Fail the requests past their deadline; re-dispatch those no node lists any more."""
        now, known_until = time.monotonic(), self.control.known_until()
        for req in list(self.table.in_flight.values()):
            if req.status.is_done:
                continue
            if req.deadline is not None and now > req.deadline:
                await self.dispatcher.fail(req, RouterError("the request timed out", 504, "TimeoutError"))
            elif known_until - req.last_listed > self.lost_after_s:
                await self.redispatcher.redispatch(req, f"no node has listed {req.wire_id} for {self.lost_after_s:g} s")
