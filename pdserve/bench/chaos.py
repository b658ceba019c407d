"""`pdserve bench serve --chaos-interval S`: fault injection during a benchmark run.

Every S seconds one live node, picked at random among `roles`, is killed with SIGKILL (or, with
`stall_s`, frozen with SIGSTOP for that long and then resumed). Nodes are found through the
router's `GET /nodes` and each node's `GET /status` (its pid), so the nodes must run on this
machine; whatever supervises them brings killed ones back (`pdserve serve` restarts them, as a
compose restart policy does). The router's `pdserve_request_retries_total` is read before and
after, and the report says what happened to every request: completed, or failed and why.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.client import auth_headers

# The run's session allows hours per request; the chaos probes must not wait that long on a node
# that is frozen (SIGSTOP) or gone.
PROBE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


@dataclass
class ChaosConfig:
    interval_s: float
    roles: tuple[str, ...] = ("prefill", "decode")
    stall_s: float = 0.0  # > 0: SIGSTOP for this long instead of SIGKILL
    seed: int = 0
    max_faults: int | None = None  # stop injecting after this many


@dataclass
class ChaosEvent:
    t: float  # seconds since the run started
    action: str  # "kill" | "stall"
    node_id: str
    pid: int


@dataclass
class ChaosLog:
    events: list[ChaosEvent] = field(default_factory=list)
    retries_before: float = 0.0
    retries_after: float = 0.0


async def run_chaos(session: aiohttp.ClientSession, base_url: str, cfg: ChaosConfig, log: ChaosLog,
                    start: float) -> None:
    """Inject a fault every `cfg.interval_s` until cancelled."""
    rng = random.Random(cfg.seed)
    while cfg.max_faults is None or len(log.events) < cfg.max_faults:
        await asyncio.sleep(cfg.interval_s)
        target = await _pick(session, base_url, cfg.roles, rng)
        if target is None:
            continue
        node_id, pid = target
        action = "stall" if cfg.stall_s > 0 else "kill"
        try:
            os.kill(pid, signal.SIGSTOP if action == "stall" else signal.SIGKILL)
        except ProcessLookupError:
            continue
        log.events.append(ChaosEvent(round(time.perf_counter() - start, 3), action, node_id, pid))
        print(f"chaos: {action} {node_id} (pid {pid})", flush=True)
        if action == "stall":
            asyncio.get_running_loop().call_later(cfg.stall_s, _resume, pid)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


async def _pick(session, base_url: str, roles, rng: random.Random) -> tuple[str, int] | None:
    try:
        async with session.get(base_url + "/nodes", headers=auth_headers(), timeout=PROBE_TIMEOUT) as r:
            nodes = [n for n in (await r.json())["nodes"] if n["ready"] and n["role"] in roles]
        if not nodes:
            return None
        node = rng.choice(nodes)
        async with session.get(node["status_url"] + "/status", timeout=PROBE_TIMEOUT) as r:
            return node["node_id"], int((await r.json())["pid"])
    except (aiohttp.ClientError, KeyError, ValueError, asyncio.TimeoutError):
        return None


async def router_retries(session: aiohttp.ClientSession, base_url: str) -> float:
    """The router's retry counter (0 when it has none, e.g. not a pdserve router)."""
    try:
        async with session.get(base_url + "/metrics", timeout=PROBE_TIMEOUT) as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return 0.0
    return retries_in(text)


def retries_in(metrics_text: str) -> float:
    """`pdserve_request_retries_total` from a router's /metrics text (0 when absent)."""
    for line in metrics_text.splitlines():
        if line.startswith("pdserve_request_retries_total"):
            return float(line.split()[-1])
    return 0.0


def chaos_report(log: ChaosLog, records) -> str:
    """What was done, and what happened to every request."""
    ok = sum(r.success for r in records)
    errors = Counter(r.error.splitlines()[0][:160] for r in records if not r.success)
    lines = [f"chaos: {len(log.events)} faults injected: "
             + (", ".join(f"{e.action} {e.node_id} at {e.t:.1f}s" for e in log.events) or "none"),
             f"chaos: {ok} of {len(records)} requests completed; {len(records) - ok} ended with an error; "
             f"the router re-dispatched {log.retries_after - log.retries_before:.0f}"]
    lines += [f"chaos:   {n} x {msg}" for msg, n in errors.most_common()]
    return "\n".join(lines)


def base_url_of(api_url: str) -> str:
    """http://host:port from the endpoint URL."""
    scheme, _, rest = api_url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"
