"""The checks both ends of the hand-off make against a `KVLayout`: do a request's block ids and
token count fit a pool of that layout (a rank's pool, its heads, is checked by kvtransfer.heads).

    pool:     [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (`layout_shape`: every head)
    request:  num_tokens tokens in block_ids, block_size tokens per block, the last one partly full

The sender checks its own `KVReady` against its own pool before it takes ownership of the blocks;
the receiver checks the same `KVReady` against the layout the peer sent in its handshake, and its
own destination blocks against its own pool. One function each, so both ends refuse the same things.
"""

from __future__ import annotations

from pdserve.kvtransfer.payload import DTYPES
from pdserve.protocol.messages import KVLayout, KVReady


def layout_shape(layout: KVLayout) -> tuple[int, ...]:
    return (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)


def bytes_per_token(layout: KVLayout) -> int:
    """K and V of every layer for one token."""
    return layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * DTYPES[layout.dtype].itemsize


def blocks_error(block_ids: list[int], num_tokens: int, layout: KVLayout, whose: str = "the pool's") -> str | None:
    """Why `num_tokens` tokens cannot live in `block_ids` of a pool of `layout`; None when they can."""
    if num_tokens <= 0 or num_tokens > len(block_ids) * layout.block_size:
        return f"{len(block_ids)} blocks of {layout.block_size} cannot hold {num_tokens} tokens"
    if any(not 0 <= b < layout.num_blocks for b in block_ids):
        return f"block ids out of {whose} range [0, {layout.num_blocks})"
    return None


def ready_error(ready: KVReady, layout: KVLayout, whose: str = "the pool's") -> str | None:
    """Why `ready` cannot describe a request in a pool of `layout` (the sender's own pool, or the
    layout the sender announced in its handshake); None when it can."""
    if ready.block_size != layout.block_size:
        return f"KVReady block_size {ready.block_size} != {whose} block_size {layout.block_size}"
    return blocks_error(ready.block_ids, ready.num_tokens, layout, whose)
