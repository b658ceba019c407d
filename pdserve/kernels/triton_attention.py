"""Paged attention in Triton: one kernel for decode, prefill, chunked prefill and prefix-cache hits.

Lengths of one request s (as in kernels/reference.py):

    |<------------------ seq_len ------------------>|
    |<------ context_len ------>|<---- q_len ----->|

Query i sits at position context_len + i and attends to keys 0..context_len + i.

Tiling. A program owns one (query tile, request, kv head). Its BLOCK_M rows are BLOCK_Q query
tokens times the GROUP query heads that share the kv head (row m = token m // GROUP, head
m % GROUP), so each K/V tile is read once per GQA group, and BLOCK_M >= 16 keeps both tl.dot
shapes legal on sm_90 even for GROUP 1 decode. KV is walked in tiles of BLOCK_N tokens, each
token's physical block looked up in the block table, with an online softmax (exp2 domain).

Decode (max_query_len == 1) has one query tile per request, so a small batch of long sequences
would leave most SMs idle: the KV range is split into num_splits partitions (flash-decoding),
each program writes its partial (max, sum, normalised out) in float32, and a second kernel
combines them. Prefill has enough query tiles and never splits.

Rows of `out` past query_start_loc[S] (padding, e.g. for CUDA graphs) are zeroed by the programs
of an extra request index S, as the torch reference does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_cache import launcher, require

# Decode splits: a partition shorter than this costs more in fixed work (q load, partial store,
# the reduce) than it gains in parallelism. Tests lower it to exercise the split path.
_MIN_PARTITION_LEN = 256
# Programs to aim for in decode; None = 4 waves of the GPU's SMs (1 on the CPU interpreter).
_TARGET_PROGRAMS: int | None = None
_MAX_SPLITS = 64
_REDUCE_BLOCK_S = 16  # splits combined per step of the reduce kernel


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # [T, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], k_cache's strides
    out_ptr,  # [T, num_heads, head_dim]
    part_out_ptr,  # [S, num_heads, num_splits, head_dim] float32 (IS_SPLIT only)
    part_max_ptr,  # [S, num_heads, num_splits] float32, log2 domain (IS_SPLIT only)
    part_sum_ptr,  # [S, num_heads, num_splits] float32 (IS_SPLIT only)
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    block_tables_ptr,  # [S, max_blocks] int32, -1 padded (never read past seq_len)
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    num_tokens,
    block_size,
    num_splits,
    partition_len,  # KV tokens per split, a multiple of BLOCK_N
    stride_q_tok,
    stride_q_head,
    stride_kv_block,
    stride_kv_tok,
    stride_kv_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program, >= BLOCK_Q * GROUP and >= 16
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # KV tokens per step, >= 16
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no tf32 rounding), else "tf32"
):
    pid = tl.program_id(0)  # query tile * num_splits + split
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_tile = pid // num_splits
    split = pid % num_splits
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_in_tile = (offs_m < BLOCK_Q * GROUP)[:, None]  # [BLOCK_M, 1]

    if seq == num_seqs:
        # Padding rows past the last request: only the first tile of the extra request index.
        if pid == 0:
            pad_start = tl.load(query_start_loc_ptr + num_seqs)
            zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=out_ptr.dtype.element_ty)
            for t0 in range(pad_start, num_tokens, BLOCK_Q):
                tok = (t0 + offs_m // GROUP).to(tl.int64)
                o_ptrs = out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
                tl.store(o_ptrs, zeros, mask=row_in_tile & (tok < num_tokens)[:, None])
        return

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    tok = q_tile * BLOCK_Q + offs_m // GROUP  # query index inside the request, [BLOCK_M]
    row_ok = row_in_tile & (tok < q_len)[:, None]  # [BLOCK_M, 1]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok,
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    # Keys this program reads: causal bound of its last query, clipped to its split.
    kv_lo = split * partition_len
    kv_hi = tl.minimum(tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q), kv_lo + partition_len)
    if q_tile * BLOCK_Q >= q_len:  # an empty tile (or a q_len 0 request) reads nothing
        kv_hi = 0
    query_pos = context_len + tok  # [BLOCK_M]

    # A finite floor instead of -inf keeps fully masked rows NaN-free (their p is exp2(-inf) = 0).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_ok = offs_n < kv_hi
        block_id = tl.load(bt_row + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
        kv_offs = block_id * stride_kv_block + (offs_n % block_size) * stride_kv_tok + kv_head * stride_kv_head
        kv_offs = kv_offs[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_cache_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = n_ok[None, :] & (offs_n[None, :] <= query_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=n_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Every valid row saw at least its own key; an empty split leaves l_i = 0 (weight 0 below).
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if IS_SPLIT:
        part = (seq.to(tl.int64) * (GROUP * tl.num_programs(2)) + head) * num_splits + split  # [BLOCK_M]
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok)
        tl.store(part_max_ptr + part[:, None], m_i[:, None], mask=row_ok)
        tl.store(part_sum_ptr + part[:, None], l_i[:, None], mask=row_ok)
    else:
        o_ptrs = out_ptr + q_rows[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [T, num_heads, head_dim]
    part_out_ptr,  # [S, num_heads, num_splits, head_dim] float32
    part_max_ptr,  # [S, num_heads, num_splits] float32
    part_sum_ptr,  # [S, num_heads, num_splits] float32
    query_start_loc_ptr,  # [S + 1] int32
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # Program (request, head): out = sum_i w_i * out_i / sum_i w_i, w_i = sum_i * 2^(max_i - max).
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    is_decode = tl.load(query_start_loc_ptr + seq + 1) - q_start == 1  # q_len 0 owns no row
    offs_d = tl.arange(0, HEAD_DIM)
    part_row = (seq * tl.num_programs(1) + head) * num_splits
    run_max = tl.full([1], -1.0e30, dtype=tl.float32)
    run_sum = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        s_ok = (offs_s < num_splits) & is_decode  # a q_len 0 request has no partials
        m = tl.load(part_max_ptr + part_row + offs_s, mask=s_ok, other=-1.0e30)
        weight_sum = tl.load(part_sum_ptr + part_row + offs_s, mask=s_ok, other=0.0)
        o = tl.load(part_out_ptr + (part_row + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None], other=0.0)
        new_max = tl.maximum(run_max, tl.max(m, axis=0))
        w = weight_sum * tl.math.exp2(m - new_max)  # [BLOCK_S]
        rescale = tl.math.exp2(run_max - new_max)
        acc = acc * rescale + tl.sum(w[:, None] * o, axis=0)
        run_sum = run_sum * rescale + tl.sum(w, axis=0)
        run_max = new_max
    result = acc / tl.where(run_sum > 0.0, run_sum, 1.0)
    o_ptrs = out_ptr + q_start.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=(offs_d < HEAD_DIM) & is_decode)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_q: int
    block_n: int
    num_warps: int
    num_stages: int


@functools.cache
def tile_config(head_dim: int, group: int, decode: bool) -> TileConfig:
    """Tile sizes per (head_dim, GQA group, decode or not); shared memory is checked by the
    compile test (K and V tiles times num_stages must fit sm_90's 227 KB)."""
    if decode:
        block_m = max(16, triton.next_power_of_2(group))
        block_n = 64 if head_dim <= 128 else 32
        return TileConfig(block_m, block_m // group, block_n, num_warps=4, num_stages=3 if head_dim <= 128 else 2)
    block_m = max(64, triton.next_power_of_2(group))
    block_n = 64 if head_dim <= 64 else 32
    num_warps = 4 if head_dim <= 64 else 8
    return TileConfig(block_m, block_m // group, block_n, num_warps, num_stages=3 if head_dim <= 128 else 2)


def attention_constexprs(dtype: torch.dtype, head_dim: int, group: int, decode: bool, split: bool) -> dict:
    cfg = tile_config(head_dim, group, decode)
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_M": cfg.block_m,
        "BLOCK_Q": cfg.block_q,
        "BLOCK_N": cfg.block_n,
        "IS_SPLIT": split,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def reduce_constexprs(head_dim: int) -> dict:
    return {"HEAD_DIM": head_dim, "BLOCK_S": _REDUCE_BLOCK_S}


def plan_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, device: torch.device
                ) -> tuple[int, int]:
    """(num_splits, partition_len) for a decode batch, from host values only."""
    target = _TARGET_PROGRAMS
    if target is None:
        target = 1  # the CPU interpreter runs programs one after another
        if device.type == "cuda":
            target = 4 * _num_sms(torch.cuda.current_device() if device.index is None else device.index)
    wanted = triton.cdiv(target, max(1, num_seqs * num_kv_heads))
    by_len = triton.cdiv(max_seq_len, _MIN_PARTITION_LEN)
    num_splits = max(1, min(wanted, by_len, _MAX_SPLITS))
    partition_len = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    return triton.cdiv(max_seq_len, partition_len), partition_len


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, max_blocks] int32, padded with -1
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim]
    plans: dict | None = None,  # nothing to keep between layers (cpu_attention.py keeps a plan)
) -> torch.Tensor:
    """Same contract as kernels.reference.paged_attention; dispatch has checked shapes and dtypes.

    Missing maxima fall back to bounds read off the shapes (T, the block table's width), never to
    a device read.
    """
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    _check_layout(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    max_query_len = num_tokens if max_query_len is None else min(max_query_len, num_tokens)
    max_seq_len = block_tables.shape[1] * block_size if max_seq_len is None else max_seq_len
    group = num_heads // num_kv_heads
    decode = max_query_len <= 1
    cfg = tile_config(head_dim, group, decode)
    if decode and max_seq_len > 0:
        num_splits, partition_len = plan_splits(num_seqs, num_kv_heads, max_seq_len, cfg.block_n, q.device)
    else:
        num_splits, partition_len = 1, 1 << 30  # one partition: the whole sequence
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # never touched
    q_tiles = max(1, triton.cdiv(max_query_len, cfg.block_q))
    grid = (q_tiles * num_splits, num_seqs + 1, num_kv_heads)  # request index S zeroes padding rows
    launcher(_paged_attention_kernel, q.device)[grid](
        q, k_cache, v_cache, out, part_out, part_max, part_sum,
        query_start_loc, seq_lens, block_tables,
        scale * 1.4426950408889634, num_seqs, num_tokens, block_size, num_splits, partition_len,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        **attention_constexprs(q.dtype, head_dim, group, decode, split),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        launcher(_reduce_splits_kernel, q.device)[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, query_start_loc, num_splits, out.stride(0), out.stride(1),
            **reduce_constexprs(head_dim), num_warps=4,
        )
    return out


def _check_layout(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables) -> None:
    """What the kernel's pointer arithmetic assumes, beyond dispatch's shape and dtype checks."""
    head_dim = q.shape[2]
    require(16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0,
            f"head_dim must be a power of two in 16..256, got {head_dim}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t is not None:
            require(t.stride(-1) == 1, f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    require(k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share strides")
    require(query_start_loc.is_contiguous() and seq_lens.is_contiguous(), "metadata must be contiguous")
    require(block_tables.stride(1) == 1, "block_tables rows must be contiguous")
