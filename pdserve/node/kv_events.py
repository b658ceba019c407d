"""A node's KVEvents: its prefix cache's keys, stored and removed, sent to every router.

The block manager records each key entering or leaving its cache (and its tier's) in a
`KVEventLog` (engine/kv_events.py) this publisher attaches. From the node's loop, after each
engine step, `publish` sends each router what changed since that router's last message, at most
every `interval_s` (so a busy node batches the events of a few steps into one message):

    deltas     KVEvents(stored, removed, seq, prev_seq) per tier, each key's last state only
    snapshot   KVEvents(reset=True, stored=every key of the tier): the first message after each
               Register to that router (the router clears the node's entries on Register), after
               a KVResync from it (it saw a gap), and when it fell behind what the log keeps;
               split into messages of at most `max_keys` keys, the later ones plain deltas

A router's messages go on the node's main socket, after its Register, so they arrive in order.
The log is trimmed to the slowest router's position. A node with prefix caching off publishes
nothing (it never stores a key), and the router routes it by load alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.kv_events import LOWER_TIER, MEMORY_TIER, KVEventLog
from pdserve.protocol.messages import KVEvents

DEFAULT_INTERVAL_S = 0.005
MAX_KEYS_PER_MESSAGE = 100_000


@dataclass
class _Reader:
    """One router's position in the log."""

    seq: int = 0
    registers: int = -1  # the link's register count when the last snapshot went (-1: never)


class KVEventPublisher:
    def __init__(self, block_manager, node_id: str, *, interval_s: float = DEFAULT_INTERVAL_S,
                 max_keys: int = MAX_KEYS_PER_MESSAGE) -> None:
        self.block_manager = block_manager
        self.node_id = node_id
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.log = KVEventLog()
        self.enabled = bool(block_manager.enable_prefix_caching)
        if self.enabled:
            block_manager.events = self.log
        self.readers: dict[str, _Reader] = {}  # router address → its position
        self._last_publish = 0.0
        self.num_snapshots = 0

    def publish(self, link, *, force: bool = False) -> None:
        """Send every router what changed since its last KVEvents (see the module docstring).
        `link`: a RouterLink, or RouterLinks (one per router)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_publish < self.interval_s:
            return
        self._last_publish = now
        seen = set()
        for one in link.each():
            seen.add(one.router_addr)
            if one.registered:
                self._publish_to(one, self.readers.setdefault(one.router_addr, _Reader()))
        for addr in [a for a in self.readers if a not in seen]:  # a router that left
            del self.readers[addr]
        if self.readers:
            self.log.trim(min(r.seq for r in self.readers.values()))

    def _publish_to(self, link, reader: _Reader) -> None:
        wants_snapshot = link.kv_resync or link.num_registers != reader.registers
        changes = None if wants_snapshot else self.log.since(reader.seq)
        if changes is None:
            self._snapshot(link, reader)
            return
        for tier, (stored, removed) in changes.items():
            self._send(link, reader, tier, stored, removed, reset=False)
        reader.seq = self.log.seq

    def _snapshot(self, link, reader: _Reader) -> None:
        link.kv_resync = False
        reader.registers = link.num_registers
        self.num_snapshots += 1
        bm = self.block_manager
        tiers = {MEMORY_TIER: bm.cached_keys()}
        if bm.tier is not None:  # a tier below memory (--kv-offload)
            tiers[LOWER_TIER] = bm.tier_keys()
        for tier, keys in tiers.items():
            self._send(link, reader, tier, keys, [], reset=True)
        reader.seq = self.log.seq

    def _send(self, link, reader: _Reader, tier: str, stored: list[int], removed: list[int], *, reset: bool) -> None:
        m = self.max_keys
        parts = ([(stored[i:i + m], []) for i in range(0, len(stored), m)]
                 + [([], removed[i:i + m]) for i in range(0, len(removed), m)]) or [([], [])]
        for i, (part_stored, part_removed) in enumerate(parts):
            link.send(KVEvents(node_id=self.node_id, seq=self.log.seq, prev_seq=reader.seq, tier=tier,
                               stored=part_stored, removed=part_removed, reset=reset and i == 0,
                               sent_at=time.time()))
            reader.seq = self.log.seq
