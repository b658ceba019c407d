"""Paged KV blocks: a free list, refcounts, and a hash-chained prefix cache (pure Python).

Ownership: the scheduler asks for blocks on a request's behalf (`allocate`), and gives them back
on finish, abort and preemption (`free`, `swap_out`). The manager owns the request → blocks
table, so a block is never referenced from two places that could disagree.

Prefix caching. A *full* block whose KV has been computed gets a key chained over its parent:
``key(i) = hash((key(i-1), tokens of block i))``. Equal keys mean equal prefixes, so a new
request whose leading blocks hash to cached keys shares those physical blocks (refcount > 1)
and skips their prefill. A block whose refcount drops to 0 keeps its key and its KV: it sits in
an LRU list and is evicted (key dropped) only when the free list runs dry.

Events. With `events` set (a KVEventLog, engine/kv_events.py), every key entering the cache
(`cache_full_blocks`) and leaving it (eviction in `_pop_free`) is recorded: the node publishes
them to its routers as KVEvents, and each router keeps an exact index (router/kv_index.py).

A tier below memory (engine/kv_tier.py; `attach_tier`, --kv-offload). An evictable cached block
taken for reuse (`_pop_free`) is first copied to the tier under its key (`tier.offload`), and
`get_computed_blocks` goes on past the last in-memory hit through the tier: each next key the tier
holds gets a block, its bytes copied back and verified (`tier.load`), and its key, and sits in the
LRU list as an ordinary evictable cached block: the request takes it as a hit like any other, and
an admission that then fails leaves it cached. The first miss or failed check ends the chain. The
manager only has ids: the bytes move in the model runner's pools, synchronously, between forwards.
Tier keys entering and leaving are KVEvents of tier "disk" (`tier_keys` is their snapshot).

Forks (parallel sampling, n > 1). `fork` gives a new table the same blocks as an existing one
(refcounts +1): the choices of one request hold the prompt's KV once. A shared block is never
written in place: `copy_on_write` first gives the writer a private copy of every shared block its
next tokens land in (in practice the partly filled last prompt block), as (src, dst) pairs the
model runner copies before the forward; the last holder writes the original.

Invariant (tests check it after every step):
    num_free_blocks + num_evictable_blocks + num_used_blocks == num_blocks
    each block's refcount == the number of tables that hold it
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.kv_events import LOWER_TIER, KVEventLog

logger = logging.getLogger(__name__)


def block_key(parent: int, tokens: Sequence[int]) -> int:
    """The prefix-cache key of a full block: chained over its parent's key (0 for the first), so
    equal keys mean equal prefixes. Python's hash of a tuple of ints: the same in every process of
    one Python version, so a router computes the keys a node's cache holds (router/kv_index.py)."""
    return hash((parent, tuple(tokens)))


def block_keys(token_ids: Sequence[int], block_size: int, num_tokens: int | None = None) -> list[int]:
    """The keys of the full blocks within the first `num_tokens` tokens (default: all)."""
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    keys, parent = [], 0
    for start in range(0, n - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


class BlockTierHooks(Protocol):
    """What the manager needs from a tier below memory (engine/kv_tier.py `BlockTier`)."""

    listener: object  # set by `attach_tier`: called (key, stored) as keys enter and leave the tier

    def offload(self, key: int, block_id: int) -> None: ...

    def load(self, key: int, block_id: int) -> bool: ...

    def touch(self, key: int) -> bool: ...

    def __contains__(self, key: int) -> bool: ...

    def keys(self) -> list[int]: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        num_host_blocks: int = 0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[int | None] = [None] * num_blocks  # prefix-cache key of a full, computed block
        self.free_ids: deque[int] = deque(range(num_blocks))  # refcount 0, no cached content
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refcount 0, cached content; LRU first
        self.cached: dict[int, int] = {}  # key → block id
        self.tables: dict[str, list[int]] = {}  # request id → its blocks in logical order
        self.keys: dict[str, list[int]] = {}  # request id → keys of its leading full blocks
        # Tables `fork` touched: the only ones that can hold a shared block where they write next
        # (prefix-cache hits are full blocks before any write), so only they need copy-on-write checks.
        self.forked: set[str] = set()
        # Host pool for swapping: only ids and a free list here; the bytes live in the model runner.
        self.num_host_blocks = num_host_blocks
        self.free_host_ids: deque[int] = deque(range(num_host_blocks))
        self.host_tables: dict[str, list[int]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which were found
        # Keys entering and leaving the cache, for the node's KVEvents (None: nobody listens).
        self.events: KVEventLog | None = None
        # The tier below memory (None: an evicted block's KV is dropped and recomputed on a hit).
        self.tier: BlockTierHooks | None = None
        self.num_tier_hits = 0  # prompt tokens served from the tier (also counted in num_prefix_hits)
        self.num_tier_offloads = 0  # evicted blocks handed to the tier (copied, or refreshed if held)
        self.num_tier_failed_loads = 0  # tier keys whose load failed its check (recomputed)

    def attach_tier(self, tier: BlockTierHooks | None) -> None:
        """Offload evicted blocks to `tier` and serve prefix hits from it (None: detach)."""
        if tier is not None and not self.enable_prefix_caching:
            raise ValueError("a KV tier needs prefix caching: its blocks are found by their prefix keys")
        self.tier = tier
        if tier is not None:
            tier.listener = self._tier_event

    def _tier_event(self, key: int, stored: bool) -> None:
        if self.events is not None:
            if stored:
                self.events.stored(key, LOWER_TIER)
            else:
                self.events.removed(key, LOWER_TIER)

    # ---- counts -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never-cached ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------
    def get_computed_blocks(self, token_ids: Sequence[int], *, load: bool = True) -> list[int]:
        """Leading full blocks of `token_ids` whose KV is cached. At least one token is left
        uncomputed, since the step that samples needs the last token's logits. With a tier and
        `load`, the chain goes on through the tier: blocks it holds are loaded back into the pool
        (as evictable cached blocks) and returned as hits. The caller passes `load=False` when
        this step has swap-outs still to read freed blocks (a load writes a block now)."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = 0
        bs = self.block_size
        tier = self.tier if load else None
        protected = 0  # hits in the LRU list, moved to its end so a load's eviction cannot take them
        num_loaded = 0
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            parent = block_key(parent, token_ids[start : start + bs])
            block_id = self.cached.get(parent)
            if block_id is None:
                if tier is None or not tier.touch(parent):  # held: now the tier's most recently used
                    break
                if len(self.free_ids) + len(self.evictable) - protected <= 0:
                    break  # no block to load into but the request's own hits
                block_id = self._load_from_tier(parent)
                if block_id is None:
                    break
                num_loaded += 1
            if tier is not None and self.ref_counts[block_id] == 0:
                self.evictable.move_to_end(block_id)
                protected += 1
            hits.append(block_id)
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += len(hits) * bs
        self.num_tier_hits += num_loaded * bs
        return hits

    def _load_from_tier(self, key: int) -> int | None:
        """A free block holding `key`'s KV from the tier, keyed and evictable (the LRU list's
        newest); None when the load failed its check (the block goes back to the free list)."""
        block_id = self._pop_free()
        try:
            ok = self.tier.load(key, block_id)
        except BaseException:
            self.ref_counts[block_id] = 0
            self.free_ids.appendleft(block_id)
            raise
        self.ref_counts[block_id] = 0
        if not ok:
            self.num_tier_failed_loads += 1
            self.free_ids.appendleft(block_id)
            return None
        self.block_keys[block_id] = key
        self.cached[key] = block_id
        self.evictable[block_id] = None
        if self.events is not None:
            self.events.stored(key)
        return block_id

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Give keys to the request's blocks that became full and computed in the last step."""
        keys = self.keys.get(request_id)
        if not self.enable_prefix_caching or (keys is not None and len(keys) >= num_computed_tokens // self.block_size):
            return  # no block became full (every decode step but one a block)
        table, keys = self.tables[request_id], self.keys.setdefault(request_id, [])
        parent = keys[-1] if keys else 0
        bs = self.block_size
        for i in range(len(keys), num_computed_tokens // bs):
            parent = block_key(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(parent)
            block_id = table[i]
            if self.block_keys[block_id] is None and parent not in self.cached:
                # Same content computed twice concurrently: the first copy stays the cached one.
                self.block_keys[block_id] = parent
                self.cached[parent] = block_id
                if self.events is not None:
                    self.events.stored(parent)

    def cached_keys(self) -> list[int]:
        """Every key the cache holds now (a KVEvents snapshot)."""
        return list(self.cached)

    def tier_keys(self) -> list[int]:
        """Every key the tier below memory holds now (a KVEvents snapshot of tier "disk")."""
        return list(self.tier.keys()) if self.tier is not None else []

    # ---- allocate / free ----------------------------------------------------------------
    def can_allocate(
        self, request_id: str, num_tokens: int, computed_block_ids: Sequence[int] = (), *, reserve: bool = False,
        write_from: int | None = None,
    ) -> bool:
        """Can the request hold `num_tokens` tokens of KV? `computed_block_ids` are prefix hits it
        would take (first admission only); `reserve` keeps the watermark back (new admissions);
        `write_from` counts the copies `copy_on_write(request_id, write_from, num_tokens)` needs."""
        have = len(self.tables.get(request_id, ())) or len(computed_block_ids)
        num_needed = self.num_blocks_for(num_tokens) - have
        if write_from is not None and request_id in self.forked:
            num_needed += len(self._shared_in(request_id, write_from, num_tokens))
        # Hit blocks that are evictable leave the pool when taken.
        num_needed += sum(1 for b in computed_block_ids if self.ref_counts[b] == 0)
        headroom = self.watermark_blocks if reserve else 0
        return num_needed <= self.num_free_blocks - headroom

    def holds(self, request_id: str, num_tokens: int) -> bool:
        """The request's table already covers `num_tokens` tokens and shares no block with another
        table: nothing to allocate or copy (most decode steps; `can_allocate` would say yes, and
        `allocate` and `copy_on_write` would do nothing)."""
        table = self.tables.get(request_id)
        return table is not None and len(table) * self.block_size >= num_tokens and request_id not in self.forked

    def allocate(self, request_id: str, num_tokens: int, computed_block_ids: Sequence[int] = ()) -> list[int]:
        """Grow the request's table to hold `num_tokens` tokens; returns its whole table."""
        table = self.tables.get(request_id)
        if table is None:
            table = self.tables[request_id] = []
            for block_id in computed_block_ids:
                self._take(block_id)
                table.append(block_id)
        elif computed_block_ids:
            raise ValueError(f"request {request_id} already holds blocks; prefix hits apply at admission only")
        num_new = self.num_blocks_for(num_tokens) - len(table)
        if num_new > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: need {num_new}, have {self.num_free_blocks} (call can_allocate first)")
        for _ in range(num_new):
            table.append(self._pop_free())
        return table

    def free(self, request_id: str) -> None:
        """Drop the request's references. The tail is released first so that, among equally old
        cached blocks, a prefix's later blocks are evicted before its earlier ones."""
        for block_id in reversed(self.tables.pop(request_id, [])):
            self._release(block_id)
        self.keys.pop(request_id, None)
        self.forked.discard(request_id)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Drop the table's blocks past those `num_tokens` tokens need: speculative decoding rolls
        back the slots of rejected draft tokens, and a block left holding nothing is released."""
        table = self.tables.get(request_id)
        if table is None:
            return
        keep = self.num_blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    # ---- forks and copy-on-write --------------------------------------------------------
    def fork(self, src_id: str, dst_id: str) -> list[int]:
        """Give `dst_id` a table holding the same blocks as `src_id` (refcounts +1, no copy)."""
        if dst_id in self.tables:
            raise ValueError(f"request {dst_id} already holds blocks")
        table = self.tables[dst_id] = list(self.tables[src_id])
        for block_id in table:
            self.ref_counts[block_id] += 1
        if src_id in self.keys:
            self.keys[dst_id] = list(self.keys[src_id])
        self.forked.update((src_id, dst_id))
        return table

    def _shared_in(self, request_id: str, start: int, end: int) -> list[int]:
        """Logical indices of the request's blocks that positions [start, end) write into and
        that another table also holds."""
        if request_id not in self.forked:  # every request that never forked, every step
            return []
        table = self.tables[request_id]
        last = min(len(table), self.num_blocks_for(end))
        return [i for i in range(start // self.block_size, last) if self.ref_counts[table[i]] > 1]

    def shares_blocks_in(self, request_id: str, start: int, end: int) -> bool:
        """Positions [start, end) of the request write into a block another table holds."""
        return bool(self._shared_in(request_id, start, end))

    def copy_on_write(self, request_id: str, start: int, end: int) -> list[tuple[int, int]]:
        """Before KV is written at positions [start, end): give the request a private copy of each
        shared block the range touches. Returns (src, dst) block copies to make before the forward
        (the caller checked room with `can_allocate(..., write_from=start)`)."""
        table = self.tables[request_id]
        copies = []
        for i in self._shared_in(request_id, start, end):
            src = table[i]
            self.ref_counts[src] -= 1  # still >= 1: another table holds it
            table[i] = self._pop_free()
            copies.append((src, table[i]))
        return copies

    def _release(self, block_id: int) -> None:
        """Drop one reference; at 0 the block goes to the LRU list (cached) or the free list."""
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] > 0:
            return
        if self.block_keys[block_id] is not None:
            self.evictable[block_id] = None
        else:
            self.free_ids.append(block_id)

    def _take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            self.evictable.pop(block_id)
        self.ref_counts[block_id] += 1

    def _pop_free(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently used
            key = self.block_keys[block_id]
            if self.tier is not None:  # its KV to the tier before anything overwrites the block
                self._offload(key, block_id)
            del self.cached[key]
            self.block_keys[block_id] = None
            if self.events is not None:
                self.events.removed(key)
        self.ref_counts[block_id] = 1
        return block_id

    def _offload(self, key: int, block_id: int) -> None:
        try:
            self.tier.offload(key, block_id)
        except Exception:  # a full disk or a broken store costs recomputes, not the node
            logger.exception("KV tier: offloading block %d failed; its KV is dropped", block_id)
            return
        self.num_tier_offloads += 1

    # ---- swap to host memory ------------------------------------------------------------
    def can_swap_out(self, request_id: str) -> bool:
        return len(self.tables.get(request_id, ())) <= len(self.free_host_ids)

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request to host blocks; returns (device block, host block) copies to make
        before the next forward writes into the freed device blocks."""
        table = self.tables[request_id]
        host = [self.free_host_ids.popleft() for _ in table]
        self.host_tables[request_id] = host
        pairs = list(zip(table, host))
        self.free(request_id)
        return pairs

    def can_swap_in(self, request_id: str, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= self.num_free_blocks

    def swap_in(self, request_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Back to device blocks sized for `num_tokens`; returns (host block, device block) copies."""
        host = self.host_tables.pop(request_id)
        table = self.allocate(request_id, num_tokens)
        self.free_host_ids.extend(host)
        return list(zip(host, table))

    def free_host(self, request_id: str) -> None:
        self.free_host_ids.extend(self.host_tables.pop(request_id, []))

    # ---- checks -------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raises AssertionError when the books do not balance (used by tests)."""
        used = sum(1 for r in self.ref_counts if r > 0)
        assert len(self.free_ids) + len(self.evictable) + used == self.num_blocks, "free + cached + used != total"
        refs = [0] * self.num_blocks
        for table in self.tables.values():
            for block_id in table:
                refs[block_id] += 1
        assert refs == self.ref_counts, "refcounts disagree with the request tables"
        assert all(self.ref_counts[b] == 0 and self.block_keys[b] is not None for b in self.evictable)
        assert all(self.ref_counts[b] == 0 and self.block_keys[b] is None for b in self.free_ids)
        assert all(self.block_keys[b] == k for k, b in self.cached.items()), "cache map disagrees with block keys"
        assert self.forked <= self.tables.keys(), "a forked mark outlived its table"
        host_used = sum(len(t) for t in self.host_tables.values())
        assert host_used + len(self.free_host_ids) == self.num_host_blocks, "host blocks leaked"
