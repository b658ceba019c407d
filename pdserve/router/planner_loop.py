"""The planner's control loop in the router (`pdserve router --planner`).

Every `interval_s`: the live nodes and their fitted speed (registry.py, speed.py) and the
workload seen (`WorkloadWindow`, fed by the router at each submit and each request's end) go to
`Planner.decide` (planner.py); each role change it asks for is sent as `SetRole` to the node,
and the pool sizes it wants go to the scaler (scaling.py), if one is configured. Every decision
is logged with its reason and counted (`pdserve_planner_*` in router/metrics.py); the last one
is served at GET /planner.

With several router processes (`--api-server-count`), only the first (`--api-server-index 0`)
runs the planner: the nodes' heartbeats reach every router, so each sees the same fleet, and
one voice changes roles.

A node asked to change role stops taking new requests (its heartbeats say not ready), finishes
what it holds and registers again with its new role (node side: pdserve/cli/node.py); until
then `changing_to` marks it in /nodes and the planner counts it in its new role.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from pdserve.protocol.messages import SetRole
from pdserve.router.planner import Decision, FleetNode, Planner, WorkloadWindow
from pdserve.router.registry import DEFAULT_MAX_NUM_SEQS, NodeInfo, Registry

logger = logging.getLogger(__name__)

Send = Callable[[NodeInfo, SetRole], Awaitable[bool]]


class PlannerLoop:
    def __init__(self, planner: Planner, registry: Registry, workload: WorkloadWindow, send: Send, *,
                 scaler=None, metrics=None) -> None:
        self.planner = planner
        self.registry = registry
        self.workload = workload
        self._send = send
        self.scaler = scaler  # scaling.Scaler, or None: role changes only
        self.metrics = metrics  # RouterMetrics, or None (tests)
        self.last: Decision | None = None
        self.last_at: float | None = None

    def fleet(self) -> list[FleetNode]:
        """The nodes the planner may move: ready, or on their way to a new role (counted in it)."""
        out = []
        for n in self.registry.nodes.values():
            role = n.changing_to or n.role
            if (n.ready or n.changing_to) and role in ("prefill", "decode"):
                out.append(FleetNode(n.node_id, role, len(n.request_ids),
                                     n.register.max_num_seqs or DEFAULT_MAX_NUM_SEQS))
        return out

    async def tick(self, now: float | None = None) -> Decision:
        now = time.monotonic() if now is None else now
        nodes = self.fleet()
        fleet = self.registry.fleet_speed  # every node's steps pooled: a prefill node never decodes
        chunk = max((n.speed.chunk for n in self.registry.nodes.values()), default=fleet.chunk)
        workload = self.workload.snapshot(now)
        if workload.num_requests:  # the path policy's TPOT cost spreads a chunk over this many tokens
            self.registry.path.expected_output_tokens = workload.output_tokens
        decision = self.planner.decide(now, nodes, workload, [fleet], chunk=chunk)
        self.last, self.last_at = decision, time.time()
        for node_id, role in decision.changes:
            node = self.registry.nodes.get(node_id)
            if node is None:
                continue
            logger.info("planner: node %s %s -> %s: %s", node_id, node.role, role, decision.reason)
            node.changing_to = role
            if not await self._send(node, SetRole(role, decision.reason)):
                node.changing_to = ""
        if self.metrics is not None:
            self.metrics.observe_plan(decision)
        if self.scaler is not None and decision.desired:
            try:
                await self.scaler.apply(decision.desired, decision.reason)
            except Exception as e:  # a scaler that cannot reach its API must not stop the loop
                logger.warning("planner: scaler %s failed: %s", getattr(self.scaler, "name", "?"), e)
        return decision

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.planner.config.interval_s)
            try:
                await self.tick()
            except Exception:
                logger.exception("planner tick failed")

    def status(self) -> dict:
        d = self.last
        cfg = self.planner.config
        return {
            "slo_ttft_ms": cfg.slo_ttft_s * 1e3, "slo_tpot_ms": cfg.slo_tpot_s * 1e3,
            "interval_s": cfg.interval_s, "scaler": getattr(self.scaler, "name", None),
            "decided_at": self.last_at,
            "split": list(d.split) if d else None, "reason": d.reason if d else "",
            "changes": [list(c) for c in d.changes] if d else [], "desired": d.desired if d else {},
            "predictions": [{k: _finite(v) for k, v in p.__dict__.items()} for p in d.predictions] if d else [],
        }


def _finite(v):
    """JSON has no infinity: an infeasible prediction reads null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v
