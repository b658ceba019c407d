"""The periodic stats line (vLLM's "Avg prompt throughput ..."): every `interval_s` while the node
is busy, one INFO line from two `NodeSnapshot`s, the interval's first and last:

    prefill-1: prompt 512.3 tok/s, generation 3.1 tok/s, running 2 reqs, waiting 5 reqs,
               KV cache 12.5%, prefix cache hit rate 40.0%, KV sent 48.2 MB/s

Throughputs and rates are over the interval; running, waiting (decode: waiting for remote KV
included) and the KV cache usage are the values at its end. An interval in which nothing ran,
waited or moved prints nothing, so an idle node stays quiet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.node.metrics import NodeSnapshot

logger = logging.getLogger(__name__)

# Which way a role's KV goes (a colocated node moves none).
KV_DIRECTION = {"prefill": "sent", "decode": "received"}


def is_busy(first: NodeSnapshot, last: NodeSnapshot) -> bool:
    """Something ran, waited or moved during the interval."""
    return bool(last.num_running or last.num_waiting or last.num_leases
                or last.num_prompt_tokens != first.num_prompt_tokens
                or last.num_generation_tokens != first.num_generation_tokens
                or last.num_bytes_sent != first.num_bytes_sent
                or last.num_bytes_received != first.num_bytes_received)


def stats_line(node_id: str, role: str, first: NodeSnapshot, last: NodeSnapshot, seconds: float) -> str:
    """One line for the interval from `first` to `last` (`seconds` apart)."""
    seconds = max(seconds, 1e-9)
    queries = last.num_prefix_queries - first.num_prefix_queries
    hits = last.num_prefix_hits - first.num_prefix_hits
    usage = last.num_blocks_used / last.num_blocks_total if last.num_blocks_total else 0.0
    line = (f"{node_id}: prompt {(last.num_prompt_tokens - first.num_prompt_tokens) / seconds:.1f} tok/s, "
            f"generation {(last.num_generation_tokens - first.num_generation_tokens) / seconds:.1f} tok/s, "
            f"running {last.num_running} reqs, waiting {last.num_waiting} reqs, KV cache {100 * usage:.1f}%, "
            f"prefix cache hit rate {100 * hits / queries if queries else 0.0:.1f}%")
    if last.spec is not None and first.spec is not None:  # speculative decoding: acceptance over the interval
        drafted = last.spec.num_draft_tokens - first.spec.num_draft_tokens
        accepted = last.spec.num_accepted_tokens - first.spec.num_accepted_tokens
        line += f", draft acceptance {100 * accepted / drafted if drafted else 0.0:.1f}% of {drafted}"
    direction = KV_DIRECTION.get(role)
    if direction is not None:
        moved = getattr(last, f"num_bytes_{direction}") - getattr(first, f"num_bytes_{direction}")
        line += f", KV {direction} {_rate(moved / seconds)}"
    return line


def _rate(bytes_per_s: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.1f} {unit}"
    return f"{bytes_per_s / 1e3:.1f} kB/s"


class StatsLogger:
    """Called from the node's loop (`maybe_log`); `snapshot` only reads counters."""

    def __init__(self, node_id: str, role: str, snapshot: Callable[[], NodeSnapshot], *,
                 interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id, self.role = node_id, role
        self.interval_s = interval_s
        self._snapshot = snapshot
        self._clock = clock
        self._first = snapshot()
        self._started = clock()

    def maybe_log(self) -> str | None:
        """At the end of an interval: the line, logged when the node was busy in it (else None)."""
        now = self._clock()
        if now - self._started < self.interval_s:
            return None
        last = self._snapshot()
        line = None
        if is_busy(self._first, last):
            line = stats_line(self.node_id, self.role, self._first, last, now - self._started)
            logger.info("%s", line)
        self._first, self._started = last, now
        return line
