"""The fleet's prefix caches, exactly: block key → the nodes (and the tier) holding that block.

Every node publishes the keys its prefix cache stores and evicts (KVEvents, node/kv_events.py)
to every router; each router keeps this index from them, and the routing policies read it
(registry.py): how many of a prompt's leading tokens each node already holds.

Keys. A block's key is the engine's prefix-cache key (`block_key` in engine/block_manager.py),
the same in every process of one Python version, so the router computes a prompt's keys itself
(`prompt_keys`, with the node's block size from its Register) and looks them up. A prompt's
cached prefix on a node is its leading keys the node holds, in any tier, up to the last full
block before its last token (the engine always computes that token).

Consistency. Per node: Register clears its entries (a snapshot follows on the same socket);
a KVEvents with `reset` replaces a tier; otherwise its `prev_seq` must be the `seq` of the last
one applied, or the index asks for a resync (`apply` returns False: the caller sends KVResync)
and ignores the node's deltas until the snapshot. A node that leaves (Deregister, missed
heartbeats, a new process) is dropped with everything it held, so the index never names a
node that has left.

Costs. Memory: one set entry per (node, tier, block) (about 60-70 bytes each in CPython).
Routing: one hash per prompt block (once per request per block size) and one set lookup per
(candidate node, block) until the first miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.engine.block_manager import block_keys
from pdserve.protocol.messages import KVEvents


@dataclass
class NodeCache:
    """What one node's caches hold, per tier."""

    tiers: dict[str, set[int]] = field(default_factory=dict)
    seq: int = -1  # the last KVEvents' seq applied; -1: no snapshot since the node registered or the last gap

    @property
    def synced(self) -> bool:
        return self.seq >= 0

    def holds(self, key: int) -> bool:
        return any(key in keys for keys in self.tiers.values())

    @property
    def num_blocks(self) -> int:
        return sum(len(keys) for keys in self.tiers.values())


class KVIndex:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeCache] = {}
        self.num_gaps = 0  # deltas that did not follow on: resyncs asked for

    # ---- membership -------------------------------------------------------------------------
    def reset_node(self, node_id: str) -> None:
        """The node (re)registered: forget what it held; its snapshot follows."""
        self.nodes[node_id] = NodeCache()

    def drop(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)

    # ---- events -----------------------------------------------------------------------------
    def apply(self, msg: KVEvents) -> bool:
        """Apply one KVEvents; False when a delta does not follow the last one applied (or none
        came since the node registered): the caller asks the node for a snapshot (KVResync)."""
        cache = self.nodes.get(msg.node_id)
        if cache is None:  # not registered (the caller checks): nothing to index
            return True
        if msg.reset:
            cache.tiers[msg.tier] = set(msg.stored)
        elif not cache.synced or msg.prev_seq != cache.seq:
            self.num_gaps += 1
            cache.seq = -1
            return False
        else:
            keys = cache.tiers.setdefault(msg.tier, set())
            keys.difference_update(msg.removed)
            keys.update(msg.stored)
        cache.seq = msg.seq
        return True

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(c.num_blocks for c in self.nodes.values())

    def knows(self, node_ids: Iterable[str]) -> bool:
        """Some of these nodes reported their cache: the index can route them."""
        return any((c := self.nodes.get(n)) is not None and c.synced for n in node_ids)

    def cached_tokens(self, node_id: str, keys: Sequence[int], block_size: int) -> int:
        """Leading prompt tokens (whole blocks) `node_id` holds, from the prompt's `keys`."""
        cache = self.nodes.get(node_id)
        if cache is None or not cache.synced:
            return 0
        n = 0
        for key in keys:
            if not cache.holds(key):
                break
            n += 1
        return n * block_size


def prompt_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The prefix-cache keys of a prompt's full blocks an engine could reuse: every full block
    before the last token (as `BlockManager.get_computed_blocks` looks them up)."""
    return block_keys(token_ids, block_size, len(token_ids) - 1)
