"""KV heads across tensor-parallel ranks, for the hand-off between nodes of different TP sizes.

A node's pool is split by KV head: rank r holds the model's heads [head_start, head_end) in a pool
of its own (kvcache.shard.KVShard), every rank with the same block ids. When the TP
size exceeds the KV heads, several ranks hold the same head (replicas). The hand-off moves, for
each rank of the decode node, exactly that rank's heads, taken from the prefill ranks that hold
them (`cover`):

    prefill TP 2: [0, 2) [2, 4)          decode TP 4: [0,1) [1,2) [2,3) [3,4)
    decode rank 2 ← prefill rank 1, its heads [2, 3) (local [0, 1))

    prefill TP 1: [0, 4)                 decode TP 2: [0, 2) [2, 4)
    decode rank 1 ← prefill rank 0, its heads [2, 4)

    prefill TP 2 with 1 KV head: [0,1) [0,1)   decode TP 1: [0, 1) ← prefill rank 0 (the first replica)

`ranks_error` is the handshake's check of a peer's layout: a refused layout never reaches `cover`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kvcache.shard import KVShard
from pdserve.kvtransfer.payload import DTYPES, dtype_name, gather_tokens
from pdserve.protocol.messages import MAX_RANKS, KVLayout, KVRank


@dataclass(frozen=True)
class Piece:
    """Heads [start, end) (model-wide) of one request, read from rank `rank` of the peer."""

    rank: int
    start: int
    end: int


def cover(start: int, end: int, ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """Heads [start, end) as few pieces as possible, each from one of `ranges` (rank r's at r);
    a head several ranks hold comes from the lowest of them that reaches furthest. Raises
    ValueError for a head no rank holds."""
    pieces, cur = [], start
    while cur < end:
        holders = [(r, e) for r, (s, e) in enumerate(ranges) if s <= cur < e]
        if not holders:
            raise ValueError(f"no rank holds KV head {cur}")
        rank, reach = max(holders, key=lambda h: (h[1], -h[0]))
        pieces.append(Piece(rank, cur, min(end, reach)))
        cur = pieces[-1].end
    return pieces


def ranges_error(ranges: Sequence[Sequence[int]], num_kv_heads: int, cover_all: bool = True) -> str | None:
    """Why `ranges` ([start, end) each) are not valid head ranges of a model with `num_kv_heads`
    (none or too many, empty or out of range, or, with `cover_all`, not covering every head);
    None when they are."""
    if not ranges or len(ranges) > MAX_RANKS:
        return f"{len(ranges)} head ranges (1 to {MAX_RANKS} expected)"
    for start, end in ranges:
        if not 0 <= start < end <= num_kv_heads:
            return f"head range [{start}, {end}) is empty or outside the model's {num_kv_heads} KV heads"
    if not cover_all:
        return None
    held = set()
    for start, end in ranges:
        held.update(range(start, end))
    if len(held) != num_kv_heads:
        missing = min(set(range(num_kv_heads)) - held)
        return f"no rank holds KV head {missing}"
    return None


def ranks_error(layout: KVLayout) -> str | None:
    """Why `layout`'s ranks do not describe a pool split by KV head; None when they do."""
    if layout.tp_size != len(layout.ranks):
        return f"tp_size {layout.tp_size} but {len(layout.ranks)} rank layouts"
    return ranges_error([(r.head_start, r.head_end) for r in layout.ranks], layout.num_kv_heads)


def rank_shape(layout: KVLayout, rank: KVRank | KVShard) -> tuple[int, ...]:
    """The shape of one rank's pool: the layout's, with that rank's heads."""
    return (layout.num_layers, 2, layout.num_blocks, layout.block_size, rank.head_end - rank.head_start,
            layout.head_dim)


def as_shards(kv: Sequence[KVShard] | torch.Tensor, num_kv_heads: int, shm=None) -> list[KVShard]:
    """A node's pool as a list of shards; a plain tensor (no tensor parallelism) is one shard
    covering every head, backed by `shm` (a SharedKVPool) when given."""
    if isinstance(kv, torch.Tensor):
        return [KVShard(0, 0, num_kv_heads, kv, shm)]
    if shm is not None:
        raise ValueError("with a list of shards, each shard names its own shared-memory pool")
    return list(kv)


def check_shards(layout: KVLayout, shards: Sequence[KVShard]) -> None:
    """Raise ValueError unless `shards` are ranks 0..N-1 whose pools fit `layout` and whose head
    ranges cover every KV head."""
    if [s.rank for s in shards] != list(range(len(shards))):
        raise ValueError(f"shards must be ranks 0..N-1 in order, got {[s.rank for s in shards]}")
    error = ranges_error([(s.head_start, s.head_end) for s in shards], layout.num_kv_heads)
    if error is not None:
        raise ValueError(f"KV shards: {error}")
    for s in shards:
        if tuple(s.tensor.shape) != rank_shape(layout, s) or dtype_name(s.tensor.dtype) != layout.dtype:
            raise ValueError(f"rank {s.rank}'s pool {s.tensor.dtype}{tuple(s.tensor.shape)} does not match "
                             f"{layout.dtype}{rank_shape(layout, s)}")
        if s.shm is not None and s.shm.tensor.data_ptr() != s.tensor.data_ptr():
            raise ValueError(f"rank {s.rank}'s pool must be its shm pool's tensor for the same-host path")


def with_ranks(layout: KVLayout, ranks: list[KVRank]) -> KVLayout:
    return dataclasses.replace(layout, tp_size=len(ranks), ranks=ranks)


def rank_bytes_per_token(layout: KVLayout, num_heads: int) -> int:
    """K and V of every layer of `num_heads` heads, for one token."""
    return layout.num_layers * 2 * num_heads * layout.head_dim * DTYPES[layout.dtype].itemsize


def gather_heads(shards: Sequence[KVShard], start: int, end: int, block_ids: list[int], num_tokens: int
                 ) -> torch.Tensor:
    """Heads [start, end) (model-wide) of a request as one contiguous [num_layers, 2, num_tokens,
    end - start, head_dim] payload, gathered from the shards holding them."""
    parts = [gather_tokens(shards[p.rank].tensor, block_ids, num_tokens,
                           heads=(p.start - shards[p.rank].head_start, p.end - shards[p.rank].head_start))
             for p in cover(start, end, [(s.head_start, s.head_end) for s in shards])]
    return parts[0] if len(parts) == 1 else torch.cat([p.cpu() for p in parts], dim=3)
