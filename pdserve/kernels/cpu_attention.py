"""Paged attention for the CPU: the "cpu" backend, the default on CPU devices.

It runs the reference's own math (reference.py: the same gathers, masks and SDPA calls, so its
results are bit for bit the reference's) and removes the host work the reference repeats in every
layer. Every layer of a step passes the same metadata; the reference reads it to the host, checks
it, sorts requests into decodes, short queries and prefills, and builds the decode block ids and
padding masks, 30 times per step for a 30-layer model. Here that work is a plan, built once per
step and reused by the step's other layers: the caller passes `plans`, a dict that lives as long
as the metadata holds the same values (AttentionMetadata.plans: built with each step's metadata,
so a plan is never served to another step). Without `plans`, every call builds its own.

Why a compiled kernel: batched float32 bmm attention with GQA folded into the query rows, float32
SDPA over widened bf16 blocks, and a plain C loop over the block table are no faster than the
reference's gather + SDPA on a CPU (the tiny decode GEMMs, group-size rows per KV head, run far
below peak, and the bf16 widening and layout copies cost more than SDPA's bf16 path saves). A faster
decode needs a register-blocked, multithreaded kernel that reads the blocks in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

# Called through the module (reference._x), so what patches the reference patches this backend too.
from pdserve.kernels import cpu_native, reference


@dataclass(frozen=True)
class _DecodeChunk:
    """Decode requests attended by one SDPA call, with everything that depends only on metadata."""

    rows: slice | torch.Tensor  # q/out rows: a slice for a pure decode batch, else [n] int64
    block_ids: torch.Tensor  # [n * num_blocks] int64, -1 padding read as block 0
    mask: torch.Tensor  # [n, 1, num_blocks * block_size] bool, True = attend


@dataclass(frozen=True)
class _Plan:
    layout: reference._HostLayout
    decode_ids: list[int]  # requests with one query token
    # (the compiled module, contiguous block tables, sequences and their q rows [n] int64) when the
    # kernel serves this step's decodes: resolved once per step, not once per layer
    native_decode: tuple[object, torch.Tensor, torch.Tensor, torch.Tensor] | None
    short: dict[int, list[int]]  # q_len -> requests: verifications batched per length
    prefill_ids: list[int]  # the rest of q_len > 1, one SDPA call (or one compiled call) each
    # the compiled module when it attends this step's prefill chunks (bf16 on an AMX CPU, head_dim
    # 64 or 128: cpu_amx_attention.cpp), else None and SDPA does
    native_prefill: object | None
    metadata: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (seq_lens, block_tables, k_cache), for the chunks

    @cached_property
    def decode_chunks(self) -> list[_DecodeChunk]:
        """The torch path's decode chunks: built when a step first takes that path, not when the
        compiled kernel serves every layer."""
        if not self.decode_ids:
            return []
        return _plan_decodes(*self.metadata[:2], self.layout, self.decode_ids, self.metadata[2])


# head_dim values the compiled prefill attention takes (cpu_amx_attention.cpp)
PREFILL_HEAD_DIMS = (64, 128)

# Where a step's plans keep its _DirectDecode (dispatch.paged_attention asks for it first).
DIRECT_DECODE = "cpu-direct-decode"


@dataclass(frozen=True)
class _DirectDecode:
    """A step of decodes only, every one served by the compiled kernel: the later layers' calls go
    straight to it. Set by the step's first call, after dispatch's checks and the plan's; a call
    shaped otherwise (another q or cache shape or dtype, a non-contiguous tensor) gets None and
    takes the checked path, so the later layers skip its Python."""

    q_shape: torch.Size
    cache_shape: torch.Size
    dtype: torch.dtype
    native: object
    tables: torch.Tensor
    seq_lens: torch.Tensor
    seqs: torch.Tensor
    rows: torch.Tensor

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor | None:
        if q.shape != self.q_shape or k_cache.shape != self.cache_shape or v_cache.shape != self.cache_shape \
                or q.dtype != self.dtype or k_cache.dtype != self.dtype or v_cache.dtype != self.dtype \
                or not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu) \
                or not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()):
            return None
        out = torch.empty_like(q)
        self.native.decode_attention(q, k_cache, v_cache, self.tables, self.seq_lens, self.seqs, self.rows, out, scale)
        return out


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
    plans: dict | None = None,  # kept by the caller for one step's metadata (module docstring)
) -> torch.Tensor:
    """Causal attention of each request's new queries over its paged KV; returns out."""
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # Besides the metadata values, the decode chunking depends on these (reference._decode_chunk_size).
    key = (
        "cpu",
        q.shape[0],
        k_cache.shape[1:],
        k_cache.dtype,
        torch.get_num_threads(),
        reference._DECODE_CHUNK_BYTES,
    )
    plan = None if plans is None else plans.get(key)
    if plan is None:
        plan = _build_plan(query_start_loc, seq_lens, block_tables, q.shape[0], k_cache)
        if plans is not None:
            plans[key] = plan
    reference._check_maxima(plan.layout, max_query_len, max_seq_len)
    # Rows past the last request are padding (e.g. for CUDA graphs): give them defined values.
    if plan.layout.q_starts[-1] < out.shape[0]:
        out[plan.layout.q_starts[-1] :].zero_()
    if plan.native_decode is not None and _heads_contiguous(q) and _heads_contiguous(out) \
            and k_cache.is_contiguous() and v_cache.is_contiguous():
        native, tables, seqs, rows = plan.native_decode
        native.decode_attention(q, k_cache, v_cache, tables, seq_lens, seqs, rows, out, scale)
        if plans is not None and DIRECT_DECODE not in plans and not plan.prefill_ids and not plan.short \
                and plan.layout.q_starts[-1] == out.shape[0] and q.is_contiguous():
            plans[DIRECT_DECODE] = _DirectDecode(q.shape, k_cache.shape, q.dtype, native, tables, seq_lens, seqs, rows)
    else:
        for chunk in plan.decode_chunks:
            _attend_decode_chunk(q, k_cache, v_cache, chunk, scale, out)
    native = plan.native_prefill
    if native is not None and not (_heads_contiguous(q) and _heads_contiguous(out) and k_cache.is_contiguous()
                                   and v_cache.is_contiguous() and block_tables.dtype == torch.int32):
        native = None
    for s in plan.prefill_ids:
        if native is not None:
            layout = plan.layout
            native.prefill_attention(q, k_cache, v_cache, block_tables[s].contiguous(), layout.q_starts[s],
                                     layout.q_lens[s], layout.seq_lens[s], out, scale)
        else:
            reference._attend_one_prefill(q, k_cache, v_cache, block_tables[s], plan.layout, s, scale, out)
    for q_len, ids in plan.short.items():
        reference._attend_short_queries(
            q, k_cache, v_cache, block_tables, plan.layout, ids, q_len, scale, out
        )
    return out


def _build_plan(
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    num_tokens: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
) -> _Plan:
    """The reference's checks (same messages) and request sorting, then the decode chunks."""
    block_size = k_cache.shape[1]
    layout = reference._read_layout(query_start_loc, seq_lens, num_tokens, block_size, block_tables.shape[1])
    decode_ids = [s for s, q_len in enumerate(layout.q_lens) if q_len == 1]
    short: dict[int, list[int]] = {}
    prefill_ids = []
    for s, q_len in enumerate(layout.q_lens):
        if 1 < q_len <= reference._SHORT_QUERY_MAX and q_len < layout.seq_lens[s]:
            short.setdefault(q_len, []).append(s)
        elif q_len > 1:
            prefill_ids.append(s)
    native = None
    if decode_ids and k_cache.device.type == "cpu" and k_cache.dtype in cpu_native.DTYPES:
        module = cpu_native.load()  # q has the cache's dtype (dispatch checks it)
        if module is not None:
            native = (module, block_tables.contiguous(), torch.tensor(decode_ids, dtype=torch.int64),
                      torch.tensor([layout.q_starts[s] for s in decode_ids]))
    native_prefill = None
    if prefill_ids and k_cache.device.type == "cpu" and k_cache.dtype == torch.bfloat16 \
            and k_cache.shape[-1] in PREFILL_HEAD_DIMS:
        module = cpu_native.load()
        if module is not None and module.amx_available():
            native_prefill = module
    return _Plan(layout, decode_ids, native, short, prefill_ids, native_prefill,
                 (seq_lens, block_tables, k_cache))


def _heads_contiguous(t: torch.Tensor) -> bool:
    """[T, heads, head_dim] with each token's heads packed (what the compiled kernels index)."""
    return t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]


def _plan_decodes(
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
    layout: reference._HostLayout,
    decode_ids: list[int],
    k_cache: torch.Tensor,
) -> list[_DecodeChunk]:
    """reference._attend_decodes's chunks, rows, block ids and masks, computed once."""
    device = block_tables.device
    dec_seq_lens = [layout.seq_lens[s] for s in decode_ids]
    rows = [layout.q_starts[s] for s in decode_ids]
    is_pure = rows == list(range(len(decode_ids)))
    if len(decode_ids) == len(layout.seq_lens):
        dec_tables, dec_lens_t = block_tables, seq_lens
    else:
        ids_t = torch.tensor(decode_ids, device=device)
        dec_tables, dec_lens_t = block_tables.index_select(0, ids_t), seq_lens.index_select(0, ids_t)
    rows_t = None if is_pure else torch.tensor(rows, device=device)
    chunk = reference._decode_chunk_size(k_cache, max(dec_seq_lens))
    block_size = k_cache.shape[1]
    chunks = []
    for start in range(0, len(decode_ids), chunk):
        end = min(start + chunk, len(decode_ids))
        num_blocks = -(-max(dec_seq_lens[start:end]) // block_size)
        block_ids = dec_tables[start:end, :num_blocks].clamp(min=0).flatten().long()
        positions = torch.arange(num_blocks * block_size, device=device)
        mask = (positions[None, :] < dec_lens_t[start:end, None])[:, None, :]
        chunk_rows = slice(start, end) if rows_t is None else rows_t[start:end]
        chunks.append(_DecodeChunk(chunk_rows, block_ids, mask))
    return chunks


def _attend_decode_chunk(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    chunk: _DecodeChunk,
    scale: float,
    out: torch.Tensor,  # [T, num_heads, head_dim]
) -> None:
    n = chunk.mask.shape[0]
    k = _gather_kv(k_cache, chunk.block_ids, n)  # [n, kv_heads, L, d]
    v = _gather_kv(v_cache, chunk.block_ids, n)
    pure = isinstance(chunk.rows, slice)
    q_chunk = q[chunk.rows] if pure else q.index_select(0, chunk.rows)  # [n, num_heads, d]
    result = reference._attend_masked(q_chunk[:, None], k, v, chunk.mask, scale)[:, 0]
    if pure:
        out[chunk.rows] = result
    else:
        out.index_copy_(0, chunk.rows, result)


def _gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_ids: torch.Tensor,  # [n * num_blocks_used] int64
    n: int,
) -> torch.Tensor:  # [n, num_kv_heads, num_blocks_used * block_size, head_dim], a strided view
    blocks = cache.index_select(0, block_ids)
    return blocks.view(n, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)
