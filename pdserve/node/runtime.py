"""A node process's life, whatever its role (`run_node`):

    parse flags, logging ─▶ fault hook, exposure check (exit 2: an exposed socket without keys),
      stop handlers, CURVE keys, node id, served model name
      ─▶ status server up (/health 503: a health check sees "loading", not a refused port)
      ─▶ the role's `build(setup)`: engine, KV endpoint(s), RouterLinks, node   (prefill/, decode/; a
         node that may change role: cli/node.py, a node/role_switch.py RoleSwitcher around both)
      ─▶ warm-up ─▶ status server ready (/health 200)
      ─▶ `serve_node`: register (with every router), loop, drain on SIGTERM/SIGINT, deregister
      ─▶ everything opened is closed, in reverse order, however it ended

What a role builds is closed through `setup.close_later`, so the runtime owns every socket, pool
and server a node process opens.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdserve.engine.loader import served_model_name
from pdserve.node.args import check_exposure, load_curve_keys
from pdserve.node.engine_wire import register_message
from pdserve.node.faults import FaultInjection
from pdserve.node.router_discovery import RouterDiscovery, parse_router_specs
from pdserve.node.router_link import RouterLink, advertise_host
from pdserve.node.router_links import RouterLinks
from pdserve.node.stats import StatsLogger
from pdserve.node.status_server import StatusServer
from pdserve.protocol.exposure import InsecureExposureError

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Node(Protocol):
    """What the runtime needs from a prefill or decode node."""

    engine: object  # LLMEngine: warmed up before the node is served
    link: RouterLink | RouterLinks
    draining: bool  # set by serve_node: heartbeats say "not ready"
    metrics: object  # NodeMetrics: `render()` for GET /metrics

    def run_once(self) -> None: ...
    def is_idle(self) -> bool: ...
    def status(self) -> dict: ...
    def metrics_snapshot(self): ...  # NodeSnapshot


@dataclass
class NodeSetup:
    """What the runtime has prepared when the role's `build` runs."""

    args: argparse.Namespace
    role: str  # "prefill", "decode" or "both"
    node_id: str
    served_model_name: str
    host: str  # the host peers reach this node's endpoints at
    status_url: str  # advertised in Register.metrics_url
    curve: object  # protocol.curve.CurveKeys, or None
    faults: FaultInjection | None
    stack: ExitStack

    def close_later(self, closeable: T) -> T:
        """Close `closeable` when the node stops (before what was registered earlier)."""
        self.stack.callback(closeable.close)
        return closeable

    def router_link(self, engine, *, kv_addr: str = "") -> RouterLinks:
        """The links to the routers (--router, resolved), their Register describing `engine` and
        where to reach the node."""
        register = register_message(self.node_id, self.role, engine, self.served_model_name, kv_addr=kv_addr,
                                    metrics_url=self.status_url)
        specs = parse_router_specs(self.args.router, self.args.api_server_count)
        discovery = self.close_later(RouterDiscovery(specs, refresh_s=self.args.router_refresh_s))
        return self.close_later(RouterLinks(discovery, register, curve=self.curve))


def run_node(parser: argparse.ArgumentParser, build: Callable[[NodeSetup], Node],
             argv: list[str] | None = None) -> int:
    """A node process, from its flags to its exit code. The parser's `role` (a flag or a default)
    names the role; `build` makes the node (see the module docstring)."""
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        faults = FaultInjection.from_args(args)
        parse_router_specs(args.router, args.api_server_count)
    except ValueError as e:
        parser.error(str(e))
    try:  # before the keys and the model load, so the refusal is immediate
        check_exposure(args, logger)
    except InsecureExposureError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    stop = install_stop_handlers()
    curve = load_curve_keys(args)
    node_id = args.node_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    host = advertise_host(args.host, args.advertise_host)
    with ExitStack() as stack:
        status = StatusServer(args.host, args.status_port, advertise_host=host)
        stack.callback(status.close)
        setup = NodeSetup(args, args.role, node_id, served_model_name(args.model, args.served_model_name), host,
                          status.url, curve, faults, stack)
        node = build(setup)
        node.engine.warm_up()
        status.set_ready(node.status, node.metrics.render)
        kv_addr = node.link.register_msg.kv_addr
        logger.info("%s ready (%sstatus %s), registering with %s", node_id, f"kv {kv_addr}, " if kv_addr else "",
                    status.url, node.link.router_addr)
        stats = StatsLogger(node_id, args.role, node.metrics_snapshot)
        serve_node(node, node.link, stop_flag=stop, drain_timeout_s=args.drain_timeout, stats=stats)
    return 0


def serve_node(node: Node, link: RouterLink | RouterLinks, *, stop_flag: list[bool], drain_timeout_s: float = 20.0,
               stats: StatsLogger | None = None) -> None:
    """A node's life: register, loop until asked to stop, then drain: heartbeats say "not ready"
    so the router sends nothing new, the node finishes what it holds (for at most
    `drain_timeout_s`), then deregisters (the router re-dispatches anything left) and returns.
    `stop_flag[0]` is set by the stop handlers (sockets are only touched from this loop).
    A step that raises (a tensor-parallel rank died, say) fails the node as a whole: it
    deregisters at once, so the router re-dispatches its requests without waiting for the
    heartbeat timeout, and the error propagates (the process exits non-zero; a supervisor
    restarts it)."""
    link.register()
    try:
        _node_loop(node, link, stop_flag, drain_timeout_s, stats)
    except Exception:
        logger.exception("%s failed; deregistering", link.register_msg.node_id)
        link.deregister()
        raise


def _node_loop(node: Node, link: RouterLink | RouterLinks, stop_flag: list[bool], drain_timeout_s: float,
               stats: StatsLogger | None) -> None:
    drain_deadline = None
    while True:
        node.run_once()
        if stats is not None:
            stats.role = getattr(node, "role", stats.role)  # a node that changed role (SetRole) logs as its new one
            stats.maybe_log()
        if stop_flag[0]:
            if drain_deadline is None:
                node.draining = True
                drain_deadline = time.monotonic() + drain_timeout_s
                logger.info("%s draining", link.register_msg.node_id)
            if node.is_idle() or time.monotonic() > drain_deadline:
                link.deregister()
                return


def install_stop_handlers() -> list[bool]:
    """SIGTERM/SIGINT set a flag the node loop reads (sockets are touched only from the loop)."""
    flag = [False]

    def on_signal(signum, frame) -> None:
        flag[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return flag
