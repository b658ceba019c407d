"""Plain-torch KV-cache write and paged attention.

This is the reference every other kernel is tested against (backend "torch"). It is also the
math of the CPU engine's hot path: cpu_attention.py (backend "cpu", the default on CPU devices)
calls the functions below and only moves the per-layer host work (reading and checking the
metadata, building decode masks) to once per step. So this module avoids per-token Python loops,
and a change here changes the CPU engine (PDSERVE_ATTENTION_BACKEND=torch runs it on this module
alone).

Lengths of one request s, as the batch metadata defines them:

    |<------------------ seq_len ------------------>|
    |<------ context_len ------>|<---- q_len ----->|
      KV already in the cache      new this step

Query i of request s sits at position context_len + i and attends to keys 0..context_len + i.
That one rule covers decode (q_len 1), prefill (context_len 0), chunked prefill and prefix-cache
hits. A request with q_len 0 owns no rows of q or out and is skipped.

Two paths:
- decode requests (q_len 1) are batched: their blocks are gathered into a padded
  [n, num_kv_heads, L, head_dim] tensor and one SDPA call with a padding mask attends them all.
  The batch is cut into chunks of about _DECODE_CHUNK_BYTES of gathered K, because a fresh
  allocation of hundreds of MB costs more in page faults than the attention itself, while chunks
  of a few MB are recycled by the allocator and still warm in cache when SDPA reads them.
- longer queries (prefill, chunked prefill) go one request at a time; each is already a large op.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import torch.nn.functional as F

# Upper bound on the bytes of gathered K per decode chunk (the same again for V).
_DECODE_CHUNK_BYTES = 8 << 20
# Queries up to this long that follow cached context (speculative verifications) are batched per length.
_SHORT_QUERY_MAX = 33


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int32, block * block_size + offset, -1 = skip
) -> None:
    """Write each token's K/V into its slot of the paged cache; slots of -1 are skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    # view, not reshape: the write must land in the cache itself, never in a copy.
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, kv_heads, d]
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    valid = slot_mapping >= 0  # [T]
    if bool(valid.all()):
        slots = slot_mapping.long()
    else:
        slots = slot_mapping[valid].long()
        key, value = key[valid], value[valid]
    flat_k.index_copy_(0, slots, key)
    flat_v.index_copy_(0, slots, value)


@dataclass(frozen=True)
class _HostLayout:
    """The batch metadata read to the host once per call, so no per-request device reads."""

    q_starts: list[int]  # [S + 1] query_start_loc
    q_lens: list[int]  # [S]
    seq_lens: list[int]  # [S]


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, KV length after this step
    block_tables: torch.Tensor,  # [S, max_blocks] int32, padded with -1
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], q's dtype
    plans: dict | None = None,  # nothing to keep between layers (cpu_attention.py keeps a plan)
) -> torch.Tensor:
    """Causal attention of each request's new queries over its paged KV; returns out."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    block_size, max_blocks = k_cache.shape[1], block_tables.shape[1]
    layout = _read_layout(query_start_loc, seq_lens, q.shape[0], block_size, max_blocks)
    _check_maxima(layout, max_query_len, max_seq_len)
    # Rows past the last request are padding (e.g. for CUDA graphs): give them defined values.
    out[layout.q_starts[-1] :].zero_()

    decode_ids = [s for s, q_len in enumerate(layout.q_lens) if q_len == 1]
    if decode_ids:
        _attend_decodes(q, k_cache, v_cache, seq_lens, block_tables, layout, decode_ids, scale, out)
    short: dict[int, list[int]] = {}  # q_len -> requests: speculative verifications, batched per length
    for s, q_len in enumerate(layout.q_lens):
        if 1 < q_len <= _SHORT_QUERY_MAX and q_len < layout.seq_lens[s]:
            short.setdefault(q_len, []).append(s)
        elif q_len > 1:
            _attend_one_prefill(q, k_cache, v_cache, block_tables[s], layout, s, scale, out)
    for q_len, ids in short.items():
        _attend_short_queries(q, k_cache, v_cache, block_tables, layout, ids, q_len, scale, out)
    return out


def _read_layout(
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_lens: torch.Tensor,  # [S]
    num_tokens: int,
    block_size: int,
    max_blocks: int,
) -> _HostLayout:
    """Read the metadata once and check the values the kernels rely on."""
    q_starts = query_start_loc.tolist()
    q_lens = [end - start for start, end in pairwise(q_starts)]
    layout = _HostLayout(q_starts, q_lens, seq_lens.tolist())
    if q_starts[0] != 0 or q_starts[-1] > num_tokens:
        raise ValueError(
            f"query_start_loc must start at 0 and end at most at T={num_tokens}, "
            f"got {q_starts[0]}..{q_starts[-1]}"
        )
    for s, (q_len, seq_len) in enumerate(zip(q_lens, layout.seq_lens, strict=True)):
        if q_len < 0 or seq_len < q_len:
            raise ValueError(f"request {s}: need 0 <= q_len <= seq_len, got q_len={q_len}, seq_len={seq_len}")
        if seq_len > max_blocks * block_size:
            raise ValueError(
                f"request {s}: seq_len={seq_len} needs more than the block table's "
                f"{max_blocks} blocks of {block_size}"
            )
    return layout


def _check_maxima(layout: _HostLayout, max_query_len: int | None, max_seq_len: int | None) -> None:
    """The host-provided maxima are bounds the Triton kernels size their grids by: catch bad ones."""
    if max_query_len is not None:
        actual = max(layout.q_lens, default=0)
        if max_query_len < actual:
            raise ValueError(f"max_query_len={max_query_len} is below the batch's {actual}")
    if max_seq_len is not None:
        actual = max(layout.seq_lens, default=0)
        if max_seq_len < actual:
            raise ValueError(f"max_seq_len={max_seq_len} is below the batch's {actual}")


def _attend_decodes(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    layout: _HostLayout,
    decode_ids: list[int],  # requests with q_len 1, in batch order
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]
) -> None:
    """All decode requests in a few batched SDPA calls (see the module docstring)."""
    num_decodes = len(decode_ids)
    dec_seq_lens = [layout.seq_lens[s] for s in decode_ids]
    rows = [layout.q_starts[s] for s in decode_ids]
    # Pure decode batch: the decode rows are exactly 0..n-1, so slices replace gathers.
    is_pure = rows == list(range(num_decodes))
    if len(decode_ids) == len(layout.seq_lens):
        dec_tables, dec_lens_t = block_tables, seq_lens  # [n, max_blocks], [n]
    else:
        ids_t = torch.tensor(decode_ids, device=q.device)
        dec_tables, dec_lens_t = block_tables.index_select(0, ids_t), seq_lens.index_select(0, ids_t)
    rows_t = None if is_pure else torch.tensor(rows, device=q.device)

    chunk = _decode_chunk_size(k_cache, max(dec_seq_lens))
    block_size = k_cache.shape[1]
    for start in range(0, num_decodes, chunk):
        end = min(start + chunk, num_decodes)
        num_blocks = -(-max(dec_seq_lens[start:end]) // block_size)
        k = _gather_kv(k_cache, dec_tables[start:end, :num_blocks])  # [n, kv_heads, L, d]
        v = _gather_kv(v_cache, dec_tables[start:end, :num_blocks])
        positions = torch.arange(k.shape[2], device=q.device)  # [L]
        mask = (positions[None, :] < dec_lens_t[start:end, None])[:, None, :]  # [n, 1, L]
        if is_pure:
            q_chunk = q[start:end]  # [n, num_heads, d]
        else:
            q_chunk = q.index_select(0, rows_t[start:end])
        result = _attend_masked(q_chunk[:, None], k, v, mask, scale)[:, 0]  # [n, num_heads, d]
        if is_pure:
            out[start:end] = result
        else:
            out.index_copy_(0, rows_t[start:end], result)


def _attend_short_queries(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks]
    layout: _HostLayout,
    ids: list[int],  # requests whose queries are all q_len long and follow cached context
    q_len: int,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]
) -> None:
    """Short queries over cached context (a speculative verification: the last token and k drafts)
    batched as decodes are, with a per-row causal mask: query i of request s sees keys
    0..seq_len - q_len + i. One request at a time would cost one SDPA call per request and layer."""
    block_size, num_heads, head_dim = k_cache.shape[1], q.shape[1], q.shape[2]
    seq = [layout.seq_lens[s] for s in ids]
    ids_t = torch.tensor(ids, device=q.device)
    tables = block_tables.index_select(0, ids_t)  # [n, max_blocks]
    offsets = torch.arange(q_len, device=q.device)  # [q_len]
    rows = torch.tensor([layout.q_starts[s] for s in ids], device=q.device)[:, None] + offsets  # [n, q_len]
    query_pos = torch.tensor(seq, device=q.device)[:, None] - q_len + offsets  # [n, q_len]
    chunk = max(1, _decode_chunk_size(k_cache, max(seq)) // q_len)
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        num_blocks = -(-max(seq[start:end]) // block_size)
        k = _gather_kv(k_cache, tables[start:end, :num_blocks])  # [n, kv_heads, L, d]
        v = _gather_kv(v_cache, tables[start:end, :num_blocks])
        key_pos = torch.arange(k.shape[2], device=q.device)  # [L]
        mask = key_pos[None, None, :] <= query_pos[start:end, :, None]  # [n, q_len, L]
        flat_rows = rows[start:end].flatten()  # [n * q_len]
        q_chunk = q.index_select(0, flat_rows).view(end - start, q_len, num_heads, head_dim)
        result = _attend_masked(q_chunk, k, v, mask, scale)  # [n, q_len, num_heads, d]
        out.index_copy_(0, flat_rows, result.reshape(-1, num_heads, head_dim))


def _decode_chunk_size(k_cache: torch.Tensor, longest: int) -> int:
    """How many decode requests fit in one chunk of _DECODE_CHUNK_BYTES of gathered K.

    Never fewer than the thread count: SDPA parallelises over (request, kv head), so tiny chunks
    of long sequences would leave cores idle.
    """
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    padded_len = -(-longest // block_size) * block_size
    bytes_per_request = padded_len * num_kv_heads * head_dim * k_cache.element_size()
    return max(torch.get_num_threads(), _DECODE_CHUNK_BYTES // bytes_per_request)


def _attend_one_prefill(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks]
    layout: _HostLayout,
    s: int,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]
) -> None:
    """One request with q_len > 1: its queries are the last q_len positions of its sequence."""
    q_start, q_end = layout.q_starts[s], layout.q_starts[s + 1]
    seq_len, q_len = layout.seq_lens[s], layout.q_lens[s]
    num_blocks = -(-seq_len // k_cache.shape[1])
    table = block_table[None, :num_blocks]  # [1, num_blocks]
    k = _gather_kv(k_cache, table)[:, :, :seq_len]  # [1, kv_heads, seq_len, d]
    v = _gather_kv(v_cache, table)[:, :, :seq_len]
    q_s = q[q_start:q_end]  # [q_len, num_heads, d]
    if q_len == seq_len:
        # Nothing cached: plain causal attention, which SDPA runs without building a mask and
        # skipping the masked half of the work.
        result = F.scaled_dot_product_attention(
            q_s.transpose(0, 1)[None], k, v, is_causal=True, scale=scale, enable_gqa=True
        )[0].transpose(0, 1)  # [q_len, num_heads, d]
    else:
        # SDPA's is_causal aligns to the top-left corner; ours is the bottom-right one.
        context_len = seq_len - q_len
        query_pos = torch.arange(context_len, seq_len, device=q.device)  # [q_len]
        key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
        mask = key_pos[None, :] <= query_pos[:, None]  # [q_len, seq_len]
        result = _attend_masked(q_s[None], k, v, mask[None], scale)[0]
    out[q_start:q_end] = result


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    tables: torch.Tensor,  # [n, num_blocks_used], -1 = padding
) -> torch.Tensor:  # [n, num_kv_heads, num_blocks_used * block_size, head_dim]
    """Gather whole blocks; padding entries read block 0 and must be masked by the caller."""
    n, num_used = tables.shape
    ids = tables.clamp(min=0).flatten().long()  # [n * num_used]
    blocks = cache.index_select(0, ids)  # [n * num_used, block_size, kv_heads, d]
    # A strided view is fine for SDPA and saves a second copy of the gathered KV.
    return blocks.view(n, num_used * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _attend_masked(
    q: torch.Tensor,  # [B, Lq, num_heads, head_dim]
    k: torch.Tensor,  # [B, num_kv_heads, L, head_dim]
    v: torch.Tensor,  # [B, num_kv_heads, L, head_dim]
    mask: torch.Tensor,  # [B, Lq, L] bool, True = attend
    scale: float,
) -> torch.Tensor:  # [B, Lq, num_heads, head_dim]
    """SDPA with GQA folded into the query axis.

    The heads sharing a KV head (h // group) become extra query rows of that KV head, so KV is
    never repeated; SDPA's own enable_gqa falls back to a slow path on CPU when given a mask.
    """
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    q_folded = (
        q.reshape(batch, q_len, num_kv_heads, group, head_dim)
        .permute(0, 2, 3, 1, 4)
        .reshape(batch, num_kv_heads, group * q_len, head_dim)
    )
    if q_len == 1:
        folded_mask = mask[:, None]  # [B, 1, 1, L] broadcasts over kv heads and the group
    else:
        folded_mask = mask[:, None, None].expand(batch, 1, group, q_len, kv_len)
        folded_mask = folded_mask.reshape(batch, 1, group * q_len, kv_len)
    o = F.scaled_dot_product_attention(q_folded, k, v, attn_mask=folded_mask, scale=scale)
    return (
        o.view(batch, num_kv_heads, group, q_len, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(batch, q_len, num_heads, head_dim)
    )
