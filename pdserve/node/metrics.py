"""A node's Prometheus metrics, served at GET /metrics on its status port (`StatusServer`); the
same snapshots feed the periodic stats line (node.stats).

Most of them are read from the node's state when Prometheus scrapes (`NodeSnapshot`, taken by the
node's `metrics_snapshot()` in the status thread), so the engine loop pays nothing per step. The
KV transfer histograms are observed when a transfer ends (decode side: pull start → "done").
A decode node also exports the peers its KV socket refused (`pdserve_auth_refusals_total{reason}`,
counted by its KVReceiver; see protocol.curve for the reasons), and the KV bytes each of its
tensor-parallel ranks received (`pdserve_kv_bytes_received_by_rank_total{rank}`: exactly the bytes
of that rank's KV heads; one series per rank, rank "0" alone without tensor parallelism).
Every series carries `node_id` and `role` labels (the role served now); names follow vLLM's where
it has the metric. A node that changes role (SetRole) keeps one `NodeMetrics`: `set_role` moves the
series to the new role, `pdserve_node_role{role}` is 1 for the current role and 0 for the other,
and `pdserve_node_role_changes_total{from_role,to_role}` counts the changes.
One `CollectorRegistry` per node process, never the global one, so in-process tests can hold many.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from pdserve.engine.spec_decode.stats import SpecDecodeStats

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # the classic text format every Prometheus version reads
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BANDWIDTH_BUCKETS = tuple(float(1 << k) * 1e6 for k in range(17))  # 1 MB/s .. 65 GB/s, doubling


@dataclass
class NodeSnapshot:
    """A node's numbers at one instant (counters are totals since the node started)."""

    num_running: int
    num_waiting: int  # decode: includes requests waiting for remote KV (announced, no blocks yet)
    num_blocks_used: int
    num_blocks_total: int
    num_prefix_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_hits: int  # of which were found
    num_preemptions: int
    num_bytes_sent: int = 0  # prefill: KV bytes served to decode nodes over ZMQ
    num_bytes_received: int = 0  # decode: KV bytes copied into this pool (ZMQ and shared memory)
    num_leases: int = 0  # prefill: requests whose blocks are pinned for a decode node
    num_shm_transfers: int = 0  # decode: transfers done by a same-host copy
    num_zmq_transfers: int = 0  # decode: transfers pulled over ZMQ
    num_prompt_tokens: int = 0  # prompt positions whose KV a forward computed here (prefix hits excluded)
    num_generation_tokens: int = 0  # tokens sampled here
    num_outstanding_prompt_tokens: int = 0  # prefill: prompt tokens queued or in progress
    auth_refusals: dict[str, int] | None = None  # decode: peers refused on the CURVE KV socket, by reason
    bytes_received_by_rank: list[int] | None = None  # decode: KV bytes copied into rank r's pool, at r
    spec: SpecDecodeStats | None = None  # speculative decoding's counters (None: not speculating)
    kv_tier: dict[str, int] | None = None  # the tier below the pool's counters (KVTier.stats; None: no tier)


def engine_snapshot(engine, **transfer) -> NodeSnapshot:
    """The engine's part of a snapshot; `transfer` adds the node's KV hand-off counters."""
    sched, bm = engine.scheduler, engine.block_manager
    return NodeSnapshot(
        num_running=len(sched.running), num_waiting=len(sched.waiting) + sched.num_waiting_for_kv,
        num_blocks_used=bm.num_used_blocks,
        num_blocks_total=bm.num_blocks, num_prefix_queries=bm.num_prefix_queries,
        num_prefix_hits=bm.num_prefix_hits, num_preemptions=sched.num_preemptions,
        num_prompt_tokens=sched.num_prompt_tokens_computed, num_generation_tokens=sched.num_tokens_sampled,
        spec=sched.spec_stats.copy() if getattr(engine, "proposer", None) is not None else None,
        kv_tier=tier.stats() if (tier := getattr(engine, "kv_tier", None)) is not None else None,
        **transfer)


ROLES = ("prefill", "decode")  # the roles a node may switch between (SetRole); "both" never switches


class NodeMetrics:
    """`role` is the role the node serves now: every series carries it, and a role change
    (`set_role`) moves them to the new value, counts the change and flips `pdserve_node_role`."""

    def __init__(self, node_id: str, role: str, registry: CollectorRegistry | None = None) -> None:
        self.node_id, self.role = node_id, role
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["node_id", "role"]
        self._kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds", "KV transfer time per request, decode side: pull start to done",
            labels, registry=self.registry, buckets=TRANSFER_BUCKETS)
        self._kv_transfer_bandwidth = Histogram(
            "pdserve_kv_transfer_bandwidth_bytes_per_second", "Per-transfer KV bytes / transfer seconds",
            labels, registry=self.registry, buckets=BANDWIDTH_BUCKETS)
        self.role_changes = Counter(
            "pdserve_node_role_changes", "Role changes of this node process (SetRole from a router), by the "
            "roles it left and took", ["node_id", "from_role", "to_role"], registry=self.registry)
        self._collector: NodeStateCollector | None = None
        self._touch_histograms()

    def _touch_histograms(self) -> None:
        """The role's histogram series exist (at 0) before its first transfer."""
        self._kv_transfer_seconds.labels(self.node_id, self.role)
        self._kv_transfer_bandwidth.labels(self.node_id, self.role)

    @property
    def kv_transfer_seconds(self):
        return self._kv_transfer_seconds.labels(self.node_id, self.role)

    @property
    def kv_transfer_bandwidth(self):
        return self._kv_transfer_bandwidth.labels(self.node_id, self.role)

    def watch(self, snapshot: Callable[[], NodeSnapshot]) -> None:
        """Export the node's state, read by calling `snapshot()` at every scrape (a later call, by
        the node object a role change built, replaces the earlier one's)."""
        if self._collector is None:
            self._collector = NodeStateCollector(snapshot, self.node_id, self.role, metrics=self)
            self.registry.register(self._collector)
        else:
            self._collector.snapshot = snapshot

    def set_role(self, role: str) -> None:
        """The node serves `role` from now on (counted once per change)."""
        if role != self.role:
            self.role_changes.labels(self.node_id, self.role, role).inc()
            self.role = role
            self._touch_histograms()

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        self.kv_transfer_seconds.observe(seconds)
        if seconds > 0:
            self.kv_transfer_bandwidth.observe(num_bytes / seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The tier below the KV pool (--kv-offload): (stats key, kind, help)
_TIER_FAMILIES = [
    ("hits", "counter", "Blocks loaded back from the tier (verified) instead of recomputed"),
    ("misses", "counter", "Tier lookups that found nothing"),
    ("puts", "counter", "Evicted blocks written to the tier"),
    ("evictions", "counter", "Blocks the tier dropped for room (LRU)"),
    ("corrupt", "counter", "Blocks whose digest did not match when read back (dropped and recomputed)"),
    ("bytes_read", "counter", "Bytes read back from the tier"),
    ("bytes_written", "counter", "Bytes written to the tier"),
    ("keys", "gauge", "Blocks the tier holds"),
    ("capacity", "gauge", "Blocks the tier can hold"),
    ("bytes_used", "gauge", "Bytes of the tier in use"),
]


# (name, kind, help, how to read it from a snapshot)
_FAMILIES: list[tuple[str, str, str, Callable[[NodeSnapshot], float]]] = [
    ("pdserve_num_requests_running", "gauge", "Requests in the node's running batch", lambda s: s.num_running),
    ("pdserve_num_requests_waiting", "gauge", "Requests waiting for a batch slot or KV blocks",
     lambda s: s.num_waiting),
    ("pdserve_num_prompt_tokens_outstanding", "gauge", "Prefill: prompt tokens queued or in progress (the "
     "load the router balances on; a prefill autoscaling signal)", lambda s: s.num_outstanding_prompt_tokens),
    ("pdserve_kv_cache_usage_perc", "gauge", "KV blocks in use / total (0..1)",
     lambda s: s.num_blocks_used / s.num_blocks_total if s.num_blocks_total else 0.0),
    ("pdserve_kv_blocks_used", "gauge", "KV blocks held by requests", lambda s: s.num_blocks_used),
    ("pdserve_kv_blocks_total", "gauge", "KV blocks in the pool", lambda s: s.num_blocks_total),
    ("pdserve_kv_leases_held", "gauge", "Prefill: requests whose blocks are pinned under a lease",
     lambda s: s.num_leases),
    ("pdserve_prefix_cache_queries", "counter", "Prompt tokens looked up in the prefix cache",
     lambda s: s.num_prefix_queries),
    ("pdserve_prefix_cache_hits", "counter", "Prompt tokens found in the prefix cache", lambda s: s.num_prefix_hits),
    ("pdserve_num_preemptions", "counter", "Requests preempted (recompute or swap)", lambda s: s.num_preemptions),
]


class NodeStateCollector:
    """A prometheus_client custom collector: one snapshot per scrape, every family from it."""

    def __init__(self, snapshot: Callable[[], NodeSnapshot], node_id: str, role: str, *,
                 metrics: NodeMetrics | None = None) -> None:
        self.snapshot = snapshot
        self._node_id, self._role = node_id, role
        self._metrics = metrics  # the role, as it is now (None: fixed)

    @property
    def _labels(self) -> list[str]:
        return [self._node_id, self._metrics.role if self._metrics is not None else self._role]

    def _tier_families(self, stats: dict[str, int]):
        for key, kind, doc in _TIER_FAMILIES:
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(f"pdserve_kv_tier_{key}", doc, labels=["node_id", "role"])
            family.add_metric(self._labels, stats.get(key, 0))
            yield family

    def collect(self):
        snap = self.snapshot()
        role = self._labels[1]
        family = GaugeMetricFamily("pdserve_node_role", "1 for the role the node serves now, 0 for the "
                                           "others it may switch to", labels=["node_id", "role"])
        for name in (*ROLES, *([role] if role not in ROLES else [])):
            family.add_metric([self._node_id, name], 1.0 if name == role else 0.0)
        yield family
        for name, kind, doc, read in _FAMILIES:
            family_cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = family_cls(name, doc, labels=["node_id", "role"])
            family.add_metric(self._labels, read(snap))
            yield family
        sent_received = CounterMetricFamily("pdserve_kv_transfer_bytes", "KV bytes handed off: sent = served "
                                            "over ZMQ by a prefill node, received = copied into a decode "
                                            "node's pool by any path", labels=["node_id", "role", "direction"])
        sent_received.add_metric([*self._labels, "sent"], snap.num_bytes_sent)
        sent_received.add_metric([*self._labels, "received"], snap.num_bytes_received)
        yield sent_received
        if snap.bytes_received_by_rank is not None:
            by_rank = CounterMetricFamily("pdserve_kv_bytes_received_by_rank", "KV bytes copied into each "
                                          "tensor-parallel rank's pool of a decode node (exactly that rank's KV "
                                          "heads), by any path", labels=["node_id", "role", "rank"])
            for rank, num_bytes in enumerate(snap.bytes_received_by_rank):
                by_rank.add_metric([*self._labels, str(rank)], num_bytes)
            yield by_rank
        transfers = CounterMetricFamily("pdserve_kv_transfers", "KV transfers completed by a decode node, by "
                                        "path", labels=["node_id", "role", "path"])
        transfers.add_metric([*self._labels, "shm"], snap.num_shm_transfers)
        transfers.add_metric([*self._labels, "zmq"], snap.num_zmq_transfers)
        yield transfers
        if snap.spec is not None:
            yield from spec_decode_families(snap.spec, self._labels)
        if snap.kv_tier is not None:
            yield from self._tier_families(snap.kv_tier)
        if snap.auth_refusals is not None:  # a node with a bound socket (decode): its KV socket
            refusals = CounterMetricFamily("pdserve_auth_refusals", "Peers refused on the node's CURVE KV "
                                           "socket (handshake attempts), by reason: unknown_key, no_curve, "
                                           "handshake", labels=["node_id", "role", "reason"])
            for reason, count in snap.auth_refusals.items():
                refusals.add_metric([*self._labels, reason], count)
            yield refusals


def spec_decode_families(spec: SpecDecodeStats, labels: list[str]):
    """vLLM's speculative-decoding counters; the acceptance rate per position is
    accepted_tokens_per_pos / draft_tokens_per_pos of the same position (a PromQL ratio)."""
    names = ["node_id", "role"]
    for name, doc, value in (
        ("pdserve_spec_decode_num_drafts", "Verification steps of one request that had draft tokens", spec.num_drafts),
        ("pdserve_spec_decode_num_draft_tokens", "Draft tokens the target verified", spec.num_draft_tokens),
        ("pdserve_spec_decode_num_accepted_tokens", "Draft tokens the target accepted", spec.num_accepted_tokens),
    ):
        family = CounterMetricFamily(name, doc, labels=names)
        family.add_metric(labels, value)
        yield family
    for name, doc, values in (
        ("pdserve_spec_decode_num_draft_tokens_per_pos", "Draft tokens verified at each position (0 = first "
         "after the last token)", spec.num_draft_tokens_per_pos),
        ("pdserve_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position",
         spec.num_accepted_tokens_per_pos),
    ):
        family = CounterMetricFamily(name, doc, labels=[*names, "position"])
        for position, value in enumerate(values):
            family.add_metric([*labels, str(position)], value)
        yield family
