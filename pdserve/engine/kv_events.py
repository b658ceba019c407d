"""What a block manager's prefix cache gained and lost, in order: the source of a node's KVEvents.

The block manager records an event whenever a block key enters its cache (`stored`: a full,
computed block got its key) or leaves it (`removed`: the block was evicted for reuse), and the
tier below memory records its own (engine/kv_tier.py). Readers (one per router the node
reports to, node/kv_events.py) keep the sequence number they have read up to and take the events
after it with `since`; the log keeps at most `max_events`, so a reader that fell further behind
gets None and must send a snapshot instead.

    seq       events recorded so far; event i (1-based) is the i-th `stored`/`removed` call
    since(s)  the events after sequence number s, each key's last state per tier (None: trimmed)
"""

from __future__ import annotations

from collections import deque
from itertools import islice

STORED, REMOVED = 1, 0
MEMORY_TIER = "memory"  # the KV pool (the protocol's KVEvents tiers: protocol.messages.KV_TIERS)
LOWER_TIER = "disk"  # every backend below memory (engine/kv_tier.py: host or disk)
DEFAULT_MAX_EVENTS = 1 << 18


class KVEventLog:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.max_events = max_events
        self.seq = 0
        self._events: deque[tuple[int, str, int]] = deque()  # (STORED | REMOVED, tier, key), oldest first

    @property
    def first_seq(self) -> int:
        """The sequence number before the oldest event kept (readers at or past it can catch up)."""
        return self.seq - len(self._events)

    def stored(self, key: int, tier: str = MEMORY_TIER) -> None:
        self._add(STORED, tier, key)

    def removed(self, key: int, tier: str = MEMORY_TIER) -> None:
        self._add(REMOVED, tier, key)

    def _add(self, op: int, tier: str, key: int) -> None:
        self._events.append((op, tier, key))
        self.seq += 1
        if len(self._events) > self.max_events:
            self._events.popleft()

    def since(self, seq: int) -> dict[str, tuple[list[int], list[int]]] | None:
        """{tier: (stored keys, removed keys)} after `seq`, each key in the list of its last event
        (a key stored and evicted in between is only `removed`); None when the log no longer holds
        every event after `seq`."""
        if seq < self.first_seq or seq > self.seq:
            return None
        last: dict[tuple[str, int], int] = {}
        for op, tier, key in islice(self._events, seq - self.first_seq, None):
            last[(tier, key)] = op
        out: dict[str, tuple[list[int], list[int]]] = {}
        for (tier, key), op in last.items():
            stored, removed = out.setdefault(tier, ([], []))
            (stored if op == STORED else removed).append(key)
        return out

    def trim(self, seq: int) -> None:
        """Every reader is at `seq` or past it: drop the events up to it."""
        while self._events and self.first_seq < seq:
            self._events.popleft()
