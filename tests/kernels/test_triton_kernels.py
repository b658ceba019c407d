"""The Triton kernels against the float64 naive attention and the torch kernels.

Without a GPU they run in Triton's interpreter (TRITON_INTERPRET=1, set per test: kernels decide
at call time, see kernels.triton_cache.launcher), so shapes stay tiny. With a GPU the same tests
run compiled on it (the `cuda` parameter; skipped on the CPU).

Tolerances against float64 (atol = rtol): float32 1e-5; float16 2e-3; bfloat16 1e-2. Half
precision loses to rounding the probabilities to the KV dtype before P @ V (as flash attention
does) and the output; the observed worst cases are about half these (the torch reference's too).
"""

from __future__ import annotations

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from pdserve.kernels import paged_attention, reference, store_kv, triton_attention
from pdserve.kernels.triton_cache import copy_tokens_triton, gather_tokens_triton, scatter_tokens_triton
from pdserve.kvtransfer import payload
from tests.kernels.test_reference import (
    MIXED_Q_LENS,
    MIXED_SEQ_LENS,
    PagedBatch,
    make_batch,
    make_cache,
    naive_attention,
)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(
    params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU")])]
)
def device(request, monkeypatch) -> torch.device:
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return torch.device(request.param)


@pytest.fixture
def force_split(monkeypatch):
    """Split every decode into partitions of one KV tile, however short the sequences."""
    monkeypatch.setattr(triton_attention, "_MIN_PARTITION_LEN", 1)
    monkeypatch.setattr(triton_attention, "_TARGET_PROGRAMS", 1 << 20)


def on(batch: PagedBatch, device: torch.device) -> PagedBatch:
    fields = ("q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables")
    return PagedBatch(**{f: getattr(batch, f).to(device) for f in fields}, scale=batch.scale, q_lens=batch.q_lens)


def assert_triton_matches_naive(batch: PagedBatch, device: torch.device, *, host_maxima: bool = True,
                                **kwargs) -> torch.Tensor:
    if host_maxima:
        kwargs.setdefault("max_query_len", max(batch.q_lens, default=0))
        kwargs.setdefault("max_seq_len", max(batch.seq_lens.tolist(), default=0))
    got = paged_attention(*on(batch, device).args(), backend="triton", **kwargs)
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    tol = TOL[batch.q.dtype]
    torch.testing.assert_close(got.cpu().double(), naive_attention(batch), atol=tol, rtol=tol)
    return got


# ---- paged_attention ---------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])  # GQA 1, 3, 4
@pytest.mark.parametrize("head_dim", [16, 64])
def test_mixed_batch(device, block_size, num_heads, num_kv_heads, head_dim):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, block_size=block_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim)
    assert_triton_matches_naive(batch, device)


@pytest.mark.parametrize("block_size,head_dim", [(128, 32), (16, 128), (8, 256)])
def test_large_blocks_and_head_dims(device, block_size, head_dim):
    batch = make_batch([1, 6, 0, 3], [130, 6, 4, 140], block_size=block_size, num_heads=4, num_kv_heads=1,
                       head_dim=head_dim)
    assert_triton_matches_naive(batch, device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_mixed_batch(device, dtype):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=6, num_kv_heads=2, head_dim=64, dtype=dtype)
    assert_triton_matches_naive(batch, device)


def test_pure_decode_without_split(device):
    seq_lens = [1, 2, 15, 16, 17, 64, 100, 3]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=9, num_kv_heads=3)
    assert_triton_matches_naive(batch, device)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (9, 3), (8, 2), (8, 1)])  # GQA 1, 3, 4, 8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode(device, force_split, num_heads, num_kv_heads, dtype):
    # Ragged lengths across several 64-token partitions, a zero-length request and a one-token one.
    q_lens, seq_lens = [1, 1, 0, 1, 1], [5, 300, 170, 1, 193]
    batch = make_batch(q_lens, seq_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    num_splits, _ = triton_attention.plan_splits(5, num_kv_heads, 300, 64, device)
    assert num_splits == 5
    assert_triton_matches_naive(batch, device)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 128])
def test_split_decode_long_context(device, force_split, block_size):
    batch = make_batch([1, 1], [2049, 1500], block_size=block_size, num_heads=8, num_kv_heads=2, head_dim=64,
                       dtype=torch.bfloat16)
    assert_triton_matches_naive(batch, device)


def test_default_split_plan_fills_the_gpu_only_for_long_contexts(monkeypatch):
    monkeypatch.setattr(triton_attention, "_TARGET_PROGRAMS", 4 * 132)  # an H200's 132 SMs, 4 waves
    cuda = torch.device("cuda")
    assert triton_attention.plan_splits(1, 8, 8192, 64, cuda) == (32, 256)  # 66 wanted, 32 by length
    assert triton_attention.plan_splits(1, 8, 200, 64, cuda) == (1, 256)  # too short to split
    assert triton_attention.plan_splits(256, 8, 8192, 64, cuda) == (1, 8192)  # the batch fills the GPU
    assert triton_attention.plan_splits(4, 8, 1000, 64, cuda) == (4, 256)


def test_prefill_without_cache(device):
    assert_triton_matches_naive(make_batch([10, 1, 24, 2], [10, 1, 24, 2], num_heads=8, num_kv_heads=2), device)


def test_prefill_longer_than_one_query_tile(device):
    # 70 queries span two 64-row tiles (GQA 1); 30 span three tiles of 12 tokens (GQA 5, 60 rows).
    assert_triton_matches_naive(make_batch([70, 1], [90, 9], num_heads=2, num_kv_heads=2), device)
    assert_triton_matches_naive(make_batch([30, 2], [30, 40], num_heads=5, num_kv_heads=1), device)


def test_chunked_prefill_starting_mid_block(device):
    assert_triton_matches_naive(make_batch([9, 20, 4], [20, 23, 41], block_size=8), device)


def test_prefix_cache_hit_on_block_boundary(device):
    assert_triton_matches_naive(make_batch([5, 16], [37, 32], block_size=16), device)


def test_zero_length_requests(device):
    assert_triton_matches_naive(make_batch([3, 0, 1, 0, 0, 2], [3, 9, 5, 1, 0, 6]), device)
    assert_triton_matches_naive(make_batch([0, 0], [4, 0]), device)


def test_missing_host_maxima_fall_back_to_shape_bounds(device):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=6, num_kv_heads=2)
    assert_triton_matches_naive(batch, device, host_maxima=False)
    decode = make_batch([1, 1, 1], [40, 3, 17])
    assert_triton_matches_naive(decode, device, host_maxima=False)


@pytest.mark.parametrize("split", [False, True])
def test_max_seq_len_is_only_an_upper_bound(device, monkeypatch, split):
    """Decode CUDA graphs launch with max_seq_len = max_model_len whatever the batch holds. The
    bound only plans the decode split: a loose one adds partitions past every sequence, which
    read nothing and weigh 0 in the reduce, so with the same partition length the result is
    bit for bit the exact bound's. Also padding requests as the graphs build them: q_len 1,
    seq_len 1 over block 0."""
    if split:
        monkeypatch.setattr(triton_attention, "_MIN_PARTITION_LEN", 1)
        monkeypatch.setattr(triton_attention, "_TARGET_PROGRAMS", 1 << 20)
    seq_lens = [5, 300, 170, 1, 193, 1, 1]
    batch = make_batch([1] * len(seq_lens), seq_lens, num_heads=6, num_kv_heads=2)
    batch.block_tables[-2:] = 0  # the graphs' padding rows: block 0 only
    exact = assert_triton_matches_naive(batch, device)
    loose = assert_triton_matches_naive(batch, device, max_seq_len=1024)  # 16 splits of 64 when split
    if split:
        assert triton_attention.plan_splits(7, 2, 1024, 64, device) == (16, 64)
        assert triton_attention.plan_splits(7, 2, 300, 64, device) == (5, 64)
    torch.testing.assert_close(loose, exact, atol=0, rtol=0)


def test_out_is_honoured_and_padding_rows_are_zeroed(device, force_split):
    for q_lens, seq_lens in (([2, 1], [5, 9]), ([1, 1], [70, 9])):  # prefill path, split decode path
        batch = make_batch(q_lens, seq_lens)
        batch.q = torch.cat([batch.q, torch.randn(5, *batch.q.shape[1:])])  # five padding rows
        out = torch.full(batch.q.shape, 7.0, device=device)
        got = paged_attention(*on(batch, device).args(), out=out, backend="triton", max_query_len=max(q_lens),
                              max_seq_len=max(seq_lens))
        assert got is out
        num_real = sum(q_lens)
        assert torch.all(out[num_real:] == 0)
        torch.testing.assert_close(out[:num_real].cpu().double(), naive_attention(batch)[:num_real],
                                   atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_strided_q_from_fused_projection(device):
    batch = make_batch(MIXED_Q_LENS, MIXED_SEQ_LENS, num_heads=4, num_kv_heads=2)
    num_tokens, num_heads, head_dim = batch.q.shape
    fused = torch.randn(num_tokens, (num_heads + 4) * head_dim)
    fused[:, : num_heads * head_dim] = batch.q.flatten(1)
    batch.q = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    assert not batch.q.is_contiguous()
    assert_triton_matches_naive(batch, device)


def test_empty_batch(device):
    batch = make_batch([], [])
    assert paged_attention(*on(batch, device).args(), backend="triton").shape == (0, 4, 16)


def test_rejects_what_the_kernel_cannot_address(device):
    batch = on(make_batch([2, 1], [5, 9]), device)
    strided_cache = batch.k_cache.transpose(2, 3).contiguous().transpose(2, 3)  # head_dim not innermost
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        paged_attention(batch.q, strided_cache, strided_cache, *batch.args()[3:], backend="triton")
    odd = on(make_batch([2, 1], [5, 9], head_dim=24), device)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(*odd.args(), backend="triton")


@pytest.mark.skipif(isinstance(triton_attention._paged_attention_kernel, InterpretedFunction),
                    reason="TRITON_INTERPRET=1 was set when the kernels were imported")
def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch = make_batch([2, 1], [5, 9])
    with pytest.raises(ValueError, match="not available"):
        paged_attention(*batch.args(), backend="triton")
    assert torch.equal(paged_attention(*batch.args()), paged_attention(*batch.args(), backend="cpu"))


# ---- store_kv ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 16), (3, 64)])
def test_store_kv_equals_torch(device, dtype, num_kv_heads, head_dim):
    k_cache, v_cache = make_cache(num_blocks=5, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    slots = torch.tensor([3, -1, 17, 31, -1, 8, 39], dtype=torch.int32)
    # key/value as strided views of one fused projection, as the model produces them.
    fused = torch.randn(7, 3 * num_kv_heads * head_dim).to(dtype)
    key = fused[:, : num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    value = fused[:, 2 * num_kv_heads * head_dim :].view(7, num_kv_heads, head_dim)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(key, value, want_k, want_v, slots)
    got_k, got_v = k_cache.to(device), v_cache.to(device)
    store_kv(key.to(device), value.to(device), got_k, got_v, slots.to(device), backend="triton")
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)


def test_store_then_attend(device):
    k_cache, v_cache = (c.to(device) for c in make_cache(num_blocks=6))
    key, value, q = torch.randn(12, 2, 16), torch.randn(12, 2, 16), torch.randn(12, 4, 16)
    slots = torch.tensor([5 * 8 + i for i in range(8)] + [2 * 8 + i for i in range(4)], dtype=torch.int32)
    store_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), backend="triton")
    meta = [torch.tensor(x, dtype=torch.int32, device=device) for x in ([0, 12], [12], [[5, 2, -1]])]
    got = paged_attention(q.to(device), k_cache, v_cache, *meta, 0.25, backend="triton")
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), key.repeat_interleave(2, 1).transpose(0, 1),
        value.repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=0.25,
    ).transpose(0, 1)
    torch.testing.assert_close(got.cpu(), want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_store_kv_with_no_tokens(device):
    k_cache, v_cache = (c.to(device) for c in make_cache())
    before = k_cache.clone()
    empty = torch.empty(0, 2, 16, device=device)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int32, device=device), backend="triton")
    assert torch.equal(k_cache, before)


# ---- token gather/scatter ----------------------------------------------------------------


def make_pool(num_blocks: int, block_size: int, dtype=torch.float32, num_kv_heads: int = 3, head_dim: int = 16,
              num_layers: int = 2) -> torch.Tensor:
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(num_blocks)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_and_copy_equal_torch(device, dtype):
    src = make_pool(9, 8, dtype)  # rows of 3 * 16 = 48: not a power of two
    src_blocks, num_tokens = [7, 2, 5, 0], 29
    want = payload.gather_tokens(src, src_blocks, num_tokens)
    got = gather_tokens_triton(src.to(device), src_blocks, num_tokens)
    assert torch.equal(got.cpu(), want)

    dst = make_pool(5, 16, dtype)  # a different block size on the receiving side
    want_dst = dst.clone()
    payload.scatter_tokens(want_dst, [3, 1], want)
    got_dst = dst.to(device)
    scatter_tokens_triton(got_dst, [3, 1], want.to(device))
    assert torch.equal(got_dst.cpu(), want_dst)

    copied = dst.to(device)
    copy_tokens_triton(src.to(device), src_blocks, copied, [3, 1], num_tokens)
    assert torch.equal(copied.cpu(), want_dst)


def test_gather_of_nothing_and_bad_block_ids(device):
    pool = make_pool(4, 8).to(device)
    assert gather_tokens_triton(pool, [], 0).shape == (2, 2, 0, 3, 16)
    with pytest.raises(ValueError, match="out of range"):
        gather_tokens_triton(pool, [4], 3)
    with pytest.raises(ValueError, match="cannot hold"):
        gather_tokens_triton(pool, [1], 9)
