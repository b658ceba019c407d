"""The "cpu" backend against the torch reference and the float64 naive attention (float32 1e-5,
bfloat16 2e-2, the reference's own bounds). With the compiled kernels off (PDSERVE_CPU_NATIVE=0)
the backend is the reference bit for bit (it runs the reference's math); with them on, every row
they do not compute still is, and the decode rows (and, in bf16 on an AMX CPU, the prefill chunks'
rows) agree with the naive attention within the bounds.
"""

from __future__ import annotations

import os
import random
from unittest import mock

import pytest
import torch

from pdserve.kernels import cpu_attention, cpu_native, dispatch, paged_attention, reference, resolve_backend
from pdserve.kernels.dispatch import BACKEND_ENV
from tests.kernels.test_reference import PagedBatch, make_batch, naive_attention

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def decode_rows(batch: PagedBatch) -> list[int]:
    """Rows of the requests with one query token: what the compiled decode kernel computes."""
    starts = batch.query_start_loc.tolist()
    return [starts[s] for s, q_len in enumerate(batch.q_lens) if q_len == 1]


def prefill_native() -> bool:
    ops = cpu_native.load()
    return ops is not None and ops.amx_available()


def prefill_rows(batch: PagedBatch) -> list[int]:
    """Rows of the prefill chunks (q_len > 1 and not a short query over a context) that the
    compiled prefill attention computes: bf16, head_dim 64 or 128, a CPU with AMX."""
    if batch.q.dtype != torch.bfloat16 or batch.q.shape[-1] not in cpu_attention.PREFILL_HEAD_DIMS \
            or not prefill_native():
        return []
    starts, rows = batch.query_start_loc.tolist(), []
    for s, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens.tolist(), strict=True)):
        short = 1 < q_len <= reference._SHORT_QUERY_MAX and q_len < seq_len
        if q_len > 1 and not short:
            rows.extend(range(starts[s], starts[s] + q_len))
    return rows


def assert_cpu_matches(batch: PagedBatch, **kwargs) -> torch.Tensor:
    """Kernel off: cpu backend == reference exactly. Kernel on: == reference on the rows the kernel
    does not compute. Both: == naive within the dtype's tolerance."""
    tol = TOL[batch.q.dtype]
    want = paged_attention(*batch.args(), backend="torch", **kwargs)
    naive = naive_attention(batch)
    with mock.patch.dict(os.environ, {cpu_native.NATIVE_ENV: "0"}):
        plain = paged_attention(*batch.args(), backend="cpu", **kwargs)
    assert torch.equal(plain, want)
    got = paged_attention(*batch.args(), backend="cpu", **kwargs)
    assert got.dtype == batch.q.dtype and got.shape == batch.q.shape
    exact = torch.ones(got.shape[0], dtype=torch.bool)
    if cpu_native.load() is not None:
        exact[decode_rows(batch)] = False
        exact[prefill_rows(batch)] = False
    assert torch.equal(got[exact], want[exact])
    torch.testing.assert_close(got.double(), naive, atol=tol, rtol=tol)
    return got


def random_lengths(rng: random.Random, num_requests: int) -> tuple[list[int], list[int]]:
    """A mix of every kind of request the engine schedules, in random order."""
    q_lens, seq_lens = [], []
    for _ in range(num_requests):
        kind = rng.choice(["decode", "decode", "short", "prefill", "chunked", "empty"])
        q_len = {"decode": 1, "short": rng.randrange(2, 34), "empty": 0}.get(kind, rng.randrange(34, 70))
        context = 0 if kind == "prefill" else rng.randrange(1 if kind == "chunked" else 0, 120)
        q_lens.append(q_len)
        seq_lens.append(context + q_len)
    return q_lens, seq_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_random_mixed_batches_match_the_reference(dtype, seed):
    rng = random.Random(seed)
    q_lens, seq_lens = random_lengths(rng, rng.randrange(1, 12))
    num_heads, num_kv_heads = rng.choice([(4, 4), (6, 2), (9, 3), (8, 1)])
    batch = make_batch(
        q_lens,
        seq_lens,
        block_size=rng.choice([8, 16]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice([16, 64]),
        dtype=dtype,
        seed=seed,
    )
    assert_cpu_matches(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_split_into_chunks_with_rows_out_of_order(monkeypatch, dtype):
    # A tiny budget gives one chunk per thread count of requests; the prefill in front of the
    # decodes puts their rows off 0..n-1, so q and out go through index tensors.
    monkeypatch.setattr(reference, "_DECODE_CHUNK_BYTES", 1)
    seq_lens = [40, 5, 300, 17, 1, 33, 150, 16, 299, 64, 2]
    q_lens = [40] + [1] * (len(seq_lens) - 1)
    batch = make_batch(q_lens, seq_lens, num_heads=9, num_kv_heads=3, head_dim=64, dtype=dtype)
    plans = {}
    assert_cpu_matches(batch, plans=plans)
    (plan,) = [p for key, p in plans.items() if key[0] == "cpu"]
    assert len(plan.decode_chunks) > 1 and not isinstance(plan.decode_chunks[0].rows, slice)


def test_verification_queries_next_to_decodes_and_a_prefill():
    q_lens = [4, 4, 1, 4, 3, 40, 3, 5, 4, 1]
    seq_lens = [20, 20, 9, 33, 7, 40, 64, 40, 5, 70]
    assert_cpu_matches(make_batch(q_lens, seq_lens, block_size=8, num_heads=6, num_kv_heads=2))


def test_chunked_prefill_with_long_context_and_prefix_hit():
    assert_cpu_matches(make_batch([40, 48, 35], [100, 64, 35], block_size=16, num_heads=9, num_kv_heads=3))


def test_out_is_honoured_and_padding_rows_are_zeroed():
    batch = make_batch([2, 1, 40], [5, 9, 50])
    num_tokens = batch.q.shape[0]
    batch.q = torch.cat([batch.q, torch.randn(3, *batch.q.shape[1:])])  # padding rows at the end
    out = torch.full(batch.q.shape, 7.0)
    got = paged_attention(*batch.args(), out=out, backend="cpu")
    assert got is out
    assert torch.all(out[num_tokens:] == 0)
    torch.testing.assert_close(
        out[:num_tokens].double(), naive_attention(batch)[:num_tokens], atol=1e-5, rtol=1e-5
    )


def test_strided_q_and_strided_out():
    batch = make_batch([1, 3, 1, 36], [12, 9, 30, 40], num_heads=4, num_kv_heads=2)
    num_tokens, num_heads, head_dim = batch.q.shape
    fused = torch.randn(num_tokens, (num_heads + 4) * head_dim)
    fused[:, : num_heads * head_dim] = batch.q.flatten(1)
    batch.q = fused[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    out = torch.empty(num_tokens, num_heads, head_dim * 2)[:, :, :head_dim]
    assert not batch.q.is_contiguous() and not out.is_contiguous()
    assert_cpu_matches(batch)
    paged_attention(*batch.args(), out=out, backend="cpu")
    torch.testing.assert_close(out.double(), naive_attention(batch), atol=1e-5, rtol=1e-5)


def spy(monkeypatch, owner, name: str) -> list:
    """owner.name still runs; the list collects the arguments of each call."""
    calls, real = [], getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a: calls.append(a) or real(*a))
    return calls


def test_the_plan_is_kept_in_the_callers_dict_for_the_steps_other_layers(monkeypatch):
    builds = spy(monkeypatch, cpu_attention, "_build_plan")
    batch = make_batch([1, 1, 1], [30, 12, 45])
    plans = {}
    for _ in range(3):  # three layers of one step
        assert_cpu_matches(batch, plans=plans)
    assert len(builds) == 1 and sum(key[0] == "cpu" for key in plans) == 1
    # The next step's metadata comes with a new dict (AttentionMetadata.plans); without one, every
    # call builds its own: no plan outlives the values it was built from.
    batch.seq_lens[1] = 5
    batch.block_tables[2, :3] = batch.block_tables[2, :3].flip(0)
    assert_cpu_matches(batch, plans={})
    assert_cpu_matches(batch)  # kernel off, then on: a plan each
    assert len(builds) == 4


def test_the_checks_run_once_per_step_and_cache_shape_yet_a_bad_call_is_still_refused(monkeypatch):
    checks = spy(monkeypatch, dispatch, "_checked_attention")
    batch = make_batch([1, 1, 1], [30, 12, 45])
    plans = {}
    for _ in range(3):  # three layers of one step, the same caches
        paged_attention(*batch.args(), backend="cpu", plans=plans)
    assert len(checks) == 1
    args = list(batch.args())
    args[1], args[2] = batch.k_cache.clone(), batch.v_cache.clone()  # another layer's caches, same shape
    paged_attention(*args, backend="cpu", plans=plans)
    assert len(checks) == 1
    args[2] = batch.v_cache[:-1].clone()  # a V cache of another shape: checked and refused
    with pytest.raises(ValueError, match="k_cache and v_cache differ"):
        paged_attention(*args, backend="cpu", plans=plans)
    assert len(checks) == 2
    bad_q = batch.q[:, :, :8].contiguous()  # another head_dim than the caches': checked and refused
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(bad_q, *batch.args()[1:], backend="cpu", plans=plans)
    with pytest.raises(ValueError, match="out must match q"):
        paged_attention(*batch.args(), out=torch.empty(3, 4, 16, dtype=torch.float64), backend="cpu", plans=plans)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_goes_straight_to_the_kernel_after_its_first_layer(monkeypatch, dtype):
    if cpu_native.load() is None:
        pytest.skip("the compiled CPU ops are not built here (no compiler)")
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    impl_calls = []
    real = dispatch._PAGED_ATTENTION["cpu"]
    monkeypatch.setitem(dispatch._PAGED_ATTENTION, "cpu", lambda *a, **k: impl_calls.append(a) or real(*a, **k))
    batch = make_batch([1, 1, 1], [30, 12, 45], dtype=dtype)
    plans = {}
    first = paged_attention(*batch.args(), plans=plans)
    assert cpu_attention.DIRECT_DECODE in plans and len(impl_calls) == 1
    torch.testing.assert_close(first.double(), naive_attention(batch), atol=TOL[dtype], rtol=TOL[dtype])
    args = list(batch.args())
    args[1], args[2] = batch.k_cache.clone(), batch.v_cache.clone()  # the next layer's caches
    for _ in range(2):
        assert torch.equal(paged_attention(*args, plans=plans), first)
    assert len(impl_calls) == 1  # straight to the kernel
    # a call shaped otherwise takes the checked path: a strided q, another dtype, an explicit backend
    strided = torch.empty(batch.q.shape[0], batch.q.shape[1], 2 * batch.q.shape[2], dtype=dtype)[:, :, ::2]
    strided.copy_(batch.q)
    torch.testing.assert_close(paged_attention(strided, *args[1:], plans=plans), first, atol=TOL[dtype], rtol=TOL[dtype])
    assert len(impl_calls) == 2
    paged_attention(*args, backend="cpu", plans=plans)
    assert len(impl_calls) == 3
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(batch.q.to(other), *args[1:], plans=plans)
    # steps with a prompt chunk, or padding rows past the last request, keep every call checked
    for q_lens, seq_lens, padding in (([1, 5, 1], [30, 12, 45], 0), ([1, 1], [30, 12], 1)):
        plans = {}
        mixed = make_batch(q_lens, seq_lens, dtype=dtype)
        mixed.q = torch.cat([mixed.q, torch.randn(padding, *mixed.q.shape[1:]).to(dtype)])
        paged_attention(*mixed.args(), plans=plans)
        assert cpu_attention.DIRECT_DECODE not in plans


def test_the_engine_builds_one_plan_per_step_not_per_layer(monkeypatch, tmp_path):
    from pdserve.engine import LLM, SamplingParams
    from tests.conftest import TINY_SHAPE, save_tiny_model

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, torch.device("cpu")) == "cpu"
    builds = spy(monkeypatch, cpu_attention, "_build_plan")
    save_tiny_model(tmp_path / "m", "llama")
    assert TINY_SHAPE["num_hidden_layers"] >= 2
    llm = LLM(str(tmp_path / "m"), dtype="float32", num_threads=1, skip_tokenizer_init=True, num_kv_blocks=16)
    try:
        steps = 0
        llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while llm.engine.has_unfinished():
            llm.engine.step()
            steps += 1
    finally:
        llm.close()
    assert steps == 4 and len(builds) == steps


def test_empty_batch():
    batch = make_batch([], [])
    assert paged_attention(*batch.args(), backend="cpu").shape == (0, 4, 16)


BAD_INPUTS = [
    {"query_start_loc": torch.tensor([0, 2, 3])},
    {"q": torch.randn(3, 3, 16)},
    {"query_start_loc": torch.tensor([0, 3], dtype=torch.int32)},
    {"seq_lens": torch.tensor([1, 9], dtype=torch.int32)},
    {"seq_lens": torch.tensor([5, 100], dtype=torch.int32)},
    {"query_start_loc": torch.tensor([0, 2, 4], dtype=torch.int32)},
    {"query_start_loc": torch.tensor([0, 2, 1], dtype=torch.int32)},
    {"max_seq_len": 8},
    {"max_query_len": 1},
]


@pytest.mark.parametrize("changes", BAD_INPUTS)
def test_bad_inputs_get_the_reference_messages(changes):
    batch = make_batch([2, 1], [5, 9])
    fields = ["q", "k_cache", "v_cache", "query_start_loc", "seq_lens", "block_tables", "scale"]
    args = tuple(changes.get(name, getattr(batch, name)) for name in fields)
    maxima = {name: changes[name] for name in ("max_seq_len", "max_query_len") if name in changes}
    messages = []
    for backend in ("torch", "cpu"):
        with pytest.raises(ValueError) as info:
            paged_attention(*args, backend=backend, **maxima)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_default_backend_per_device_and_environment_override(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, torch.device("cpu")) == "cpu"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    assert resolve_backend("cpu", torch.device("cpu")) == "cpu"  # an explicit choice wins
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend(None, torch.device("cpu"))


# ---- the compiled decode kernel (cpu_decode_attention.cpp) -------------------------------------


def test_the_decode_kernel_builds_on_this_machine():
    # `make install` builds it; a machine with a C++ compiler must have it, or the CPU backend
    # silently runs the slower torch decode path.
    assert cpu_native.load() is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 8, 128, 8), (8, 1, 64, 16), (6, 2, 12, 4), (4, 2, 8, 16),
                          (4, 2, 96, 8), (10, 2, 40, 16)])
def test_the_decode_kernel_against_the_naive_attention(dtype, num_heads, num_kv_heads, head_dim, block_size):
    # Lengths around the 4-token blocking of the AVX2 loops and the block size; query heads per KV
    # head 3, 1, 8 (groups of 3, 3, 2), 2 and 5 (3 + 2); head_dims 64, 128 and 96 in 32-column
    # steps, 8 in 8-column steps, 40 both, 12 the portable loops. Rows out of order (a prefill
    # first), -1 padded tables, scattered blocks, sequences split over several work items.
    kernel = cpu_native.load()
    rng = random.Random(num_heads * head_dim)
    seq_lens = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 63, 130, 301]
    rng.shuffle(seq_lens)
    q_lens = [20] + [1] * len(seq_lens)
    batch = make_batch(q_lens, [40] + seq_lens, block_size=block_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, seed=head_dim)
    seqs = torch.arange(1, len(q_lens))
    rows = torch.tensor(decode_rows(batch))
    out = torch.full_like(batch.q, 3.0)
    kernel.decode_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, seqs, rows,
                            out, batch.scale)
    tol = TOL[dtype]
    torch.testing.assert_close(out[rows].double(), naive_attention(batch)[rows], atol=tol, rtol=tol)
    assert torch.all(out[:20] == 3.0)  # rows it was not given are not written


def test_the_decode_kernel_refuses_bad_inputs():
    kernel = cpu_native.load()
    batch = make_batch([1, 1], [5, 9])
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, torch.arange(2),
            torch.arange(2), torch.empty_like(batch.q), batch.scale)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        kernel.decode_attention(*(a.half() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                  for a in args))
    with pytest.raises(RuntimeError, match="int32 block tables"):
        kernel.decode_attention(*args[:3], batch.block_tables.long(), *args[4:])
    # float16 through the backend: not the kernel's, so the torch path serves it
    half = make_batch([1, 1], [5, 9], dtype=torch.float16)
    got = paged_attention(*half.args(), backend="cpu")
    assert torch.equal(got, paged_attention(*half.args(), backend="torch"))


needs_amx = pytest.mark.skipif(not prefill_native(), reason="the compiled prefill attention needs AMX-BF16; "
                               "other CPUs take SDPA, tested above (test_random_mixed_batches_match_the_reference)")


@needs_amx
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (8, 2, 128, 32), (4, 4, 64, 8), (8, 1, 128, 16)])
def test_the_prefill_kernel_against_the_naive_attention(num_heads, num_kv_heads, head_dim, block_size):
    # Chunks of 1, 16, 17 and 130 queries (whole and partial 16-query items), fresh and over a
    # cached context (a chunked prefill, a prefix hit), one past a 2048-key pass (the rescaled
    # second pass) and one longer than two passes; scattered blocks, -1 padded tables; rows of
    # other requests (a decode, a short query) left as they were.
    kernel = cpu_native.load()
    q_lens = [1, 16, 17, 130, 40, 3, 24, 1]
    seq_lens = [1, 16, 17 + 60, 130, 40 + 2030, 3 + 17, 24 + 4100, 9]
    batch = make_batch(q_lens, seq_lens, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, dtype=torch.bfloat16, seed=head_dim + block_size)
    batch.q.mul_(3)  # sharper softmax than unit scores: max and exps matter
    starts = batch.query_start_loc.tolist()
    out = torch.full_like(batch.q, 3.0)
    chunks = [0, 1, 2, 3, 4, 6]
    for s in chunks:
        kernel.prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables[s], starts[s],
                                 q_lens[s], seq_lens[s], out, batch.scale)
    rows = [r for s in chunks for r in range(starts[s], starts[s + 1])]
    others = [r for r in range(out.shape[0]) if r not in rows]
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(out[rows].double(), naive_attention(batch)[rows], atol=tol, rtol=tol)
    assert torch.all(out[others] == 3.0)  # rows it was not given are not written


@needs_amx
def test_the_prefill_kernel_refuses_bad_inputs():
    kernel = cpu_native.load()
    batch = make_batch([20], [30], head_dim=64, dtype=torch.bfloat16)
    out = torch.empty_like(batch.q)
    table = batch.block_tables[0]
    good = (batch.q, batch.k_cache, batch.v_cache, table, 0, 20, 30, out, batch.scale)
    kernel.prefill_attention(*good)
    cases = [
        ((batch.q.float(), *good[1:]), "bfloat16 q, caches and out"),
        ((*good[:3], table.long(), *good[4:]), "block_table \\[max_blocks\\] int32"),
        ((*good[:4], 0, 31, 30, out, batch.scale), "0 < q_len <= seq_len"),
        ((*good[:4], 5, 20, 30, out, batch.scale), "chunk's rows inside q"),
        ((*good[:6], 300, out, batch.scale), "needs"),
        ((*good[:3], torch.tensor([0, 99, -1, -1], dtype=torch.int32), *good[4:]), "outside the cache"),
        ((batch.q.transpose(0, 1).contiguous().transpose(0, 1), *good[1:]), "contiguous heads"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            kernel.prefill_attention(*args)
    small = make_batch([20], [30], head_dim=16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        kernel.prefill_attention(small.q, small.k_cache, small.v_cache, small.block_tables[0], 0, 20, 30,
                                 torch.empty_like(small.q), small.scale)


@needs_amx
def test_a_bf16_prefill_takes_the_kernel_and_fp32_or_other_head_dims_take_sdpa(monkeypatch):
    calls = []
    real = cpu_native.load()

    class Counting:
        def __getattr__(self, name):
            attr = getattr(real, name)
            if name != "prefill_attention":
                return attr
            return lambda *a: calls.append(a[4:7]) or attr(*a)

    monkeypatch.setitem(cpu_native._state, "module", Counting())
    for dtype, head_dim, want in [(torch.bfloat16, 64, [(0, 40, 40), (40, 50, 120)]), (torch.float32, 64, []),
                                  (torch.bfloat16, 32, [])]:
        calls.clear()
        batch = make_batch([40, 50, 1, 5], [40, 120, 7, 30], head_dim=head_dim, dtype=dtype, num_heads=6,
                           num_kv_heads=2)
        assert_cpu_matches(batch)
        assert calls == want, (dtype, head_dim)


def test_with_the_kernel_off_nothing_builds_or_loads(monkeypatch):
    monkeypatch.setenv(cpu_native.NATIVE_ENV, "0")
    assert cpu_native.load() is None
