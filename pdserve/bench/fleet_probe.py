"""What a pdserve fleet says about itself, read before and after a run: the nodes' KV pool sizes
(the prefix oracle's capacity) and the KV bytes the decode nodes received.

The router's `GET /nodes` lists the nodes ({"nodes": [{node_id, role, status_url, num_total_blocks,
...}]}; a bare list is accepted too); each node's `GET {status_url}/metrics` has the Prometheus
counter `pdserve_kv_transfer_bytes_total{node_id, role, direction}`, where direction "received" is
what was copied into a decode node's pool by any path. The bytes a run moved are the received
counters' increase over the run, summed over the nodes (a node that restarted counts from 0). Any
server that is not a pdserve router (no /nodes) gives None: the figures are reported as n/a.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from pdserve.bench.client import auth_headers

PROBE_TIMEOUT_S = 5.0
KV_BYTES_METRIC = "pdserve_kv_transfer_bytes_total"
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class FleetSnapshot:
    nodes: list[dict]
    kv_received: dict[str, float] = field(default_factory=dict)  # node_id → bytes; nodes whose metrics answered

    @property
    def cache_blocks(self) -> int | None:
        """The sum of the nodes' KV pools (every role may prefill under some policy), None if unknown."""
        sizes = [n.get("num_total_blocks") for n in self.nodes]
        sizes = [s for s in sizes if isinstance(s, int) and s > 0]
        return sum(sizes) if sizes else None


def _get(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=auth_headers()), timeout=timeout) as r:
        return r.read()


def kv_received_in(metrics_text: str) -> float | None:
    """The sum of `pdserve_kv_transfer_bytes_total{direction="received"}` samples; None without any."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m["name"] != KV_BYTES_METRIC:
            continue
        if dict(_LABEL.findall(m["labels"] or "")).get("direction") != "received":
            continue
        try:
            total += float(m["value"])
        except ValueError:
            continue
        seen = True
    return total if seen else None


def fleet_snapshot(base_url: str, timeout: float = PROBE_TIMEOUT_S) -> FleetSnapshot | None:
    """The nodes and their received-KV counters now; None when `base_url` has no /nodes."""
    try:
        doc = json.loads(_get(base_url.rstrip("/") + "/nodes", timeout))
    except (OSError, ValueError, urllib.error.URLError):
        return None
    nodes = doc.get("nodes") if isinstance(doc, dict) else doc
    if not isinstance(nodes, list):
        return None
    nodes = [n for n in nodes if isinstance(n, dict)]
    snap = FleetSnapshot(nodes)
    for node in nodes:
        url, node_id = node.get("status_url"), str(node.get("node_id"))
        if not url:
            continue
        try:
            value = kv_received_in(_get(url.rstrip("/") + "/metrics", timeout).decode(errors="replace"))
        except (OSError, ValueError, urllib.error.URLError):
            continue
        if value is not None:
            snap.kv_received[node_id] = value
    return snap


def kv_bytes_received(before: FleetSnapshot | None, after: FleetSnapshot | None) -> float | None:
    """KV bytes the nodes received between the two snapshots; None when unknown (no fleet, or no
    node's counter could be read after the run)."""
    if before is None or after is None or not after.kv_received:
        return None
    total = 0.0
    for node_id, value in after.kv_received.items():
        start = before.kv_received.get(node_id, 0.0)
        total += value - start if value >= start else value  # a lower counter: the node restarted
    return total
