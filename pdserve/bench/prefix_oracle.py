"""The oracle prefix hit rate: how many prompt tokens a fleet could at best have served from its
prefix caches, given the token sequences a benchmark run actually sent.

The replay: every successful request, in the order the requests were sent, goes through ONE prefix
cache of `capacity_blocks` blocks, the sum of the fleet's KV pools (`num_total_blocks` of every node
that `GET /nodes` lists, or `--oracle-cache-blocks`). Blocks are keyed as pdserve's engine keys them
(`pdserve/engine/block_manager.py`): block i of a sequence is `hash((key(i-1), its block_size
tokens))` with key(-1) = 0, so equal keys mean equal prefixes. A request's hits are its leading
cached blocks within all but the last prompt token (the engine always leaves one token to compute,
since sampling needs its logits: `get_computed_blocks`). Then every full block of what the request
computed (the prompt and the output but its last token) is inserted or refreshed, deepest block
first so that a prefix's later blocks are evicted before its earlier ones (as the engine frees
them), and the least recently used blocks are evicted beyond the capacity. `capacity_blocks=None`
is an unbounded cache: every reuse the sequences allow counts.

Why this is an upper bound for a fleet (an approximation of "the best any assignment of requests
to nodes could get with the same cache sizes"): a fleet splits the same capacity over nodes, so a
request can only hit blocks that are on the node it was sent to, and a prefix computed on two nodes
takes room twice; one pooled cache has neither loss. The replay also ignores the blocks that running
requests pin, counts a prefix as cached from the moment its request is sent (a concurrent request
with the same prefix may in reality miss it), and caches outputs as well as prompts (a prefill
node alone never computes the output's KV). With an unbounded cache, or one that does not fill up,
it is exactly the most any fleet can hit. When the capacity binds it is the LRU pooled cache, not
Belady's optimal eviction, and pooled LRU can in contrived cases lose to a partition of the same
size (a scan that would thrash only its own node), so it is a close, not a proven, bound there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pdserve.engine.block_manager import block_keys  # the engine's own keys

DEFAULT_BLOCK_SIZE = 16  # the engine's default block size


class PrefixOracle:
    """One LRU prefix cache of `capacity_blocks` blocks (None: unbounded), fed request by request."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, capacity_blocks: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be >= 1, got {block_size}")
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"cache capacity must be >= 0 blocks, got {capacity_blocks}")
        self.block_size, self.capacity_blocks = block_size, capacity_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def request(self, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> int:
        """Prompt tokens this request hits, then its computed blocks enter the cache."""
        bs = self.block_size
        hits = 0
        for key in block_keys(prompt_ids, bs, len(prompt_ids) - 1):  # at least one token is computed
            if key not in self.cached:
                break
            hits += bs
        computed = list(prompt_ids) + list(output_ids)[:-1]  # the last output token's KV is never computed
        for key in reversed(block_keys(computed, bs)):  # the root ends most recent: evicted last
            self.cached[key] = None
            self.cached.move_to_end(key)
        if self.capacity_blocks is not None:
            while len(self.cached) > self.capacity_blocks:
                self.cached.popitem(last=False)
        return hits


def oracle_hits(sequences: Iterable[tuple[Sequence[int], Sequence[int]]], block_size: int = DEFAULT_BLOCK_SIZE,
                capacity_blocks: int | None = None) -> list[int]:
    """Hit tokens per (prompt ids, output ids), replayed in the order given (the order sent)."""
    oracle = PrefixOracle(block_size, capacity_blocks)
    return [oracle.request(prompt, output) for prompt, output in sequences]
