"""The torch kernels against a slow, obviously-correct float64 reference written here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pdserve.kernels import paged_attention, reference, store_kv

F32_TOL = 1e-5
BF16_TOL = 2e-2


@dataclass
class PagedBatch:
    """One attention call's inputs, plus the per-request lengths they were built from."""

    q: torch.Tensor  # [T, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, -1 padded
    scale: float
    q_lens: list[int]

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.query_start_loc,
            self.seq_lens,
            self.block_tables,
            self.scale,
        )


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    block_size: int = 16,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random q and caches; each request's blocks get random, non-contiguous physical ids."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_request = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_request, default=0) + 2  # extra -1 padding columns
    num_blocks = sum(blocks_per_request) + 5  # spare blocks nobody owns
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    for s, n in enumerate(blocks_per_request):
        block_tables[s, :n] = torch.tensor(physical[:n], dtype=torch.int32)
        physical = physical[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    q_starts = [0]
    for n in q_lens:
        q_starts.append(q_starts[-1] + n)
    return PagedBatch(
        q=torch.randn(q_starts[-1], num_heads, head_dim, generator=gen).to(dtype),
        k_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(dtype),
        query_start_loc=torch.tensor(q_starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        scale=head_dim**-0.5,
        q_lens=list(q_lens),
    )


def naive_attention(batch: PagedBatch) -> torch.Tensor:  # [T, num_heads, head_dim] float64
    """Per request, per token: contiguous KV from the blocks, softmax in float64."""
    num_heads = batch.q.shape[1]
    group = num_heads // batch.k_cache.shape[2]
    heads = torch.arange(num_heads)
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for s, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = batch.q_lens[s]
        keys, values = contiguous_kv(batch, s, seq_len)  # [seq_len, kv_heads, d]
        for i in range(q_len):
            pos = seq_len - q_len + i
            q_i = batch.q[starts[s] + i].double()  # [num_heads, d]
            k = keys[: pos + 1, heads // group]  # [pos + 1, num_heads, d]
            v = values[: pos + 1, heads // group]
            scores = torch.einsum("hd,lhd->hl", q_i, k) * batch.scale
            out[starts[s] + i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v)
    return out


def contiguous_kv(batch: PagedBatch, s: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    block_size = batch.k_cache.shape[1]
    blocks = batch.block_tables[s, : math.ceil(seq_len / block_size)].long()
    keys = batch.k_cache[blocks].flatten(0, 1)[:seq_len].double()
    values = batch.v_cache[blocks].flatten(0, 1)[:seq_len].double()
    return keys, values


def assert_matches_naive(batch: PagedBatch, tol: float = F32_TOL, **kwargs) -> torch.Tensor:
    got = paged_attention(*batch.args(), **kwargs)
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    torch.testing.assert_close(got.double(), naive_attention(batch), atol=tol, rtol=tol)
    return got


# A bit of everything: decode, prefill, chunked prefill from mid-block, prefix hit on a block
# boundary, a zero-length request, a decode whose seq_len is exactly one block.
MIXED_Q_LENS = [1, 7, 0, 1, 5, 13, 1]
MIXED_SEQ_LENS = [33, 7, 20, 1, 29, 45, 32]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_mixed_batch_matches_naive(block_size, num_heads, num_kv_heads, head_dim):
    batch = make_batch(
        MIXED_Q_LENS,
        MIXED_SEQ_LENS,
        block_size=block_size,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
    assert_matches_naive(batch)


def test_pure_decode_batch_with_ragged_lengths():
    seq_lens = [1, 2, 15, 16, 17, 64, 100, 3]
    assert_matches_naive(make_batch([1] * len(seq_lens), seq_lens, num_heads=9, num_kv_heads=3))


def test_decode_split_into_chunks(monkeypatch):
    # A tiny budget forces many small chunks, the path large batches of long sequences take.
    monkeypatch.setattr(reference, "_DECODE_CHUNK_BYTES", 1)
    seq_lens = [5, 40, 17, 1, 33]
    assert_matches_naive(make_batch([1] * 5, seq_lens))
    assert_matches_naive(make_batch([1, 3, 0, 1, 1], [9, 12, 4, 70, 2], seed=1))


def test_prefill_without_cache():
    assert_matches_naive(make_batch([10, 1, 24, 2], [10, 1, 24, 2], num_heads=8, num_kv_heads=2))


def test_chunked_prefill_starting_mid_block():
    # Cached context of 11, 3 and 37 tokens: the new chunk starts inside a block.
    assert_matches_naive(make_batch([9, 20, 4], [20, 23, 41], block_size=8))


def test_prefix_cache_hit_on_block_boundary():
    # 32 and 16 tokens come from shared prefix blocks; only the tail is new.
    assert_matches_naive(make_batch([5, 16], [37, 32], block_size=16))


def test_zero_length_requests_are_skipped():
    batch = make_batch([3, 0, 1, 0, 0, 2], [3, 9, 5, 1, 0, 6])
    assert_matches_naive(batch)


def test_bfloat16_mixed_batch():
    batch = make_batch(
        MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=6, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    assert_matches_naive(batch, tol=BF16_TOL)


def test_out_is_honoured_and_padding_rows_are_zeroed():
    batch = make_batch([2, 1], [5, 9])
    out = torch.full((batch.q.shape[0] + 2, *batch.q.shape[1:]), 7.0)  # two padding rows at the end
    q = torch.cat([batch.q, torch.randn(2, *batch.q.shape[1:])])
    batch.q = q
    got = paged_attention(*batch.args(), out=out)
    assert got is out
    assert torch.all(out[3:] == 0)
    torch.testing.assert_close(out[:3].double(), naive_attention(batch)[:3], atol=F32_TOL, rtol=F32_TOL)


def test_strided_q_from_fused_projection():
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=4, num_kv_heads=2)
    num_tokens, num_heads, head_dim = batch.q.shape
    fused = torch.randn(num_tokens, (num_heads + 4) * head_dim)
    fused[:, : num_heads * head_dim] = batch.q.flatten(1)
    batch.q = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not batch.q.is_contiguous()
    assert_matches_naive(batch)


def test_host_maxima_and_backend_choice_do_not_change_the_result(monkeypatch):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS)
    plain = paged_attention(*batch.args())
    for kwargs in ({"backend": "cpu"}, {"max_query_len": 13, "max_seq_len": 45}):
        torch.testing.assert_close(paged_attention(*batch.args(), **kwargs), plain, atol=0, rtol=0)
    # The CPU default is the reference bit for bit once its compiled decode kernel is off.
    monkeypatch.setenv("PDSERVE_CPU_NATIVE", "0")
    torch.testing.assert_close(paged_attention(*batch.args(), backend="torch"), paged_attention(*batch.args()),
                               atol=0, rtol=0)


def test_empty_batch():
    batch = make_batch([], [])
    assert paged_attention(*batch.args()).shape == (0, 4, 16)


# ---- store_kv ----------------------------------------------------------------------------


def make_cache(
    num_blocks: int = 4,
    block_size: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_valid_slots_and_skips_minus_one(dtype):
    k_cache, v_cache = make_cache(dtype=dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([3, -1, 17, 31, -1, 8], dtype=torch.int32)  # blocks 0, 2, 3, 1
    key = torch.randn(6, 2, 16).to(dtype)
    value = torch.randn(6, 2, 16).to(dtype)
    store_kv(key, value, k_cache, v_cache, slots)

    written = slots >= 0
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[slots[written].long()], key[written])
    assert torch.equal(flat_v[slots[written].long()], value[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[written].long()] = False
    assert torch.equal(flat_k[untouched], k_before.view(-1, 2, 16)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view(-1, 2, 16)[untouched])


def test_store_then_attend_equals_attention_over_the_written_tokens():
    # A 12-token prefill written through slot_mapping into blocks 5 and 2, then read back.
    k_cache, v_cache = make_cache(num_blocks=6)
    key, value, q = torch.randn(12, 2, 16), torch.randn(12, 2, 16), torch.randn(12, 4, 16)
    slots = torch.tensor([5 * 8 + i for i in range(8)] + [2 * 8 + i for i in range(4)], dtype=torch.int32)
    store_kv(key, value, k_cache, v_cache, slots)
    got = paged_attention(
        q,
        k_cache,
        v_cache,
        torch.tensor([0, 12], dtype=torch.int32),
        torch.tensor([12], dtype=torch.int32),
        torch.tensor([[5, 2, -1]], dtype=torch.int32),
        0.25,
    )
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1),
        key.repeat_interleave(2, 1).transpose(0, 1),
        value.repeat_interleave(2, 1).transpose(0, 1),
        is_causal=True,
        scale=0.25,
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=F32_TOL, rtol=F32_TOL)


# ---- input checks ------------------------------------------------------------------------


def test_store_kv_rejects_bad_inputs():
    k_cache, v_cache = make_cache()
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        store_kv(key, value, k_cache, v_cache, slots.long())
    with pytest.raises(ValueError, match="3 tokens"):
        store_kv(key, value, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="dtype"):
        store_kv(key.double(), value.double(), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="num_kv_heads"):
        store_kv(torch.randn(3, 1, 16), torch.randn(3, 1, 16), k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="differ"):
        store_kv(key, value, k_cache, v_cache[:2], slots)
    strided = torch.randn(4, 16, 2, 16)[:, :8]  # blocks with gaps between them
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(key, value, strided, strided.clone()[:, :8], slots)


def _replace(batch: PagedBatch, **changes) -> tuple:
    fields = ["q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables", "scale"]
    return tuple(changes.get(name, getattr(batch, name)) for name in fields)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"query_start_loc": torch.tensor([0, 2, 3])}, "int32"),
        ({"seq_lens": torch.tensor([5, 9], dtype=torch.int32)[None]}, "1 dims"),
        ({"q": torch.randn(3, 4, 16, dtype=torch.float64)}, "dtype"),
        ({"q": torch.randn(3, 3, 16)}, "multiple"),
        ({"q": torch.randn(3, 4, 32)}, "head_dim"),
        ({"v_cache": torch.randn(3, 16, 2, 16)}, "differ"),
        ({"query_start_loc": torch.tensor([0, 3], dtype=torch.int32)}, "S \\+ 1"),
        ({"block_tables": torch.zeros(1, 3, dtype=torch.int32)}, "rows"),
        ({"seq_lens": torch.tensor([1, 9], dtype=torch.int32)}, "q_len <= seq_len"),
        ({"seq_lens": torch.tensor([5, 100], dtype=torch.int32)}, "block table"),
        ({"query_start_loc": torch.tensor([0, 2, 4], dtype=torch.int32)}, "end at most"),
        ({"query_start_loc": torch.tensor([0, 2, 1], dtype=torch.int32)}, "q_len <= seq_len"),
    ],
)
def test_paged_attention_rejects_bad_inputs(changes, message):
    batch = make_batch([2, 1], [5, 9])
    with pytest.raises(ValueError, match=message):
        paged_attention(*_replace(batch, **changes))


def test_paged_attention_rejects_bad_out_maxima_and_backend(monkeypatch):
    # Triton on a CPU tensor runs only under the interpreter; without it the backend says so.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch = make_batch([2, 1], [5, 9])
    with pytest.raises(ValueError, match="out must match"):
        paged_attention(*batch.args(), out=torch.empty(3, 4, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_attention(*batch.args(), max_seq_len=8)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_attention(*batch.args(), max_query_len=1)
    with pytest.raises(ValueError, match="not available"):
        paged_attention(*batch.args(), backend="triton")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        paged_attention(*batch.args(), backend="cuda")


@pytest.mark.parametrize("chunk_bytes", [None, 1])
def test_speculative_verification_queries_are_batched_and_exact(monkeypatch, chunk_bytes):
    # Short queries over cached context (the last token plus k drafts), several of one length,
    # next to decodes, a prefill and a lone short query; a tiny budget splits the batches.
    if chunk_bytes is not None:
        monkeypatch.setattr(reference, "_DECODE_CHUNK_BYTES", chunk_bytes)
    q_lens = [4, 4, 1, 4, 3, 12, 3, 5, 4]
    seq_lens = [20, 4 + 16, 9, 33, 7, 12, 64, 40, 5]
    assert_matches_naive(make_batch(q_lens, seq_lens, block_size=8, num_heads=6, num_kv_heads=2))
    calls = []
    monkeypatch.setattr(reference, "_attend_one_prefill", lambda *a: calls.append(a[5]) or None)
    monkeypatch.setattr(reference, "_attend_short_queries", lambda *a: calls.append(tuple(a[5])))
    paged_attention(*make_batch(q_lens, seq_lens, block_size=8).args())
    assert sorted(calls, key=str) == sorted([5, (0, 1, 3, 8), (4, 6), (7,)], key=str)
