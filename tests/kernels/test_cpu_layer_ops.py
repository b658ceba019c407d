"""The compiled CPU ops of a decoder layer (kernels/cpu_elementwise.cpp: add_rms_norm, rope_store_kv,
silu_mul) against the torch code they replace (engine/ops/: forward_native): RoPE, the K/V store and the
residual add bit for bit; RMSNorm and SiLU (summation order, a polynomial exp) within a few ulps.
Greedy sampling's argmax_rows against torch.argmax. And a whole model's forward with the ops against
the same model without them."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import llama
from pdserve.engine.models.cpu_bf16 import use_fp32_gemms_for_bf16
from pdserve.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm, RotaryEmbedding
from pdserve.engine.ops import layer_ops
from pdserve.engine.ops import linear as layers
from pdserve.kernels import cpu_native, store_kv

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    ops = cpu_native.load()
    assert ops is not None, "the compiled ops build on a machine with a C++ compiler (make install)"
    return ops


def ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference in units of the last place of `dtype` at want's magnitude; differences
    below 1e-30 count as none (silu(-88.5) is -3e-37 in torch, -0 with an exp that overflows at 88)."""
    assert torch.equal(got.isnan(), want.isnan())
    mantissa = 7 if dtype == torch.bfloat16 else 23
    scale = 2.0 ** (torch.floor(torch.log2(want.double().abs().clamp_min(1e-30))) - mantissa)
    diff = (got.double() - want.double()).nan_to_num().abs()
    return (torch.where(diff < 1e-30, 0.0, diff) / scale).max().item()


def config(**overrides) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=72, intermediate_size=136,
                num_layers=3, num_heads=6, num_kv_heads=2, head_dim=12, rms_norm_eps=1e-5,
                max_position_embeddings=256)
    return ModelConfig(**(base | overrides))


# ---- RoPE and the K/V store ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qkv_fp32", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 12), (9, 3, 64), (4, 4, 8), (4, 2, 24)])
def test_rope_store_kv_is_the_torch_code_bit_for_bit(ops, dtype, qkv_fp32, heads, kv_heads, dim):
    torch.manual_seed(heads * dim)
    cfg = config(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, hidden_size=heads * dim)
    tokens, block_size, num_blocks = 11, 4, 9
    positions = torch.randint(0, 200, (tokens,))
    rows = RotaryEmbedding(cfg, 256).at(positions, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 3
    if not qkv_fp32:
        qkv = qkv.to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens].int()
    slots[[2, 7]] = -1  # padding tokens: not stored
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache, v_cache = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    # the torch code (llama.Attention without the ops)
    q, k, v = qkv.to(dtype).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = rows(positions, q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim))
    store_kv(k, v.view(tokens, kv_heads, dim), want_k, want_v, slots)
    got_q = ops.rope_store_kv(qkv, rows.cos, rows.sin_signed, k_cache, v_cache, slots, heads)
    assert got_q.dtype == dtype and got_q.shape == (tokens, heads, dim)
    assert torch.equal(got_q, q)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)  # untouched slots too


def test_rope_store_kv_refuses_bad_inputs(ops):
    cfg = config()
    rows = RotaryEmbedding(cfg, 256).at(torch.arange(3), torch.float32)
    cache = torch.zeros(2, 4, 2, 12)
    qkv = torch.zeros(3, 10 * 12)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="qkv width"):
        ops.rope_store_kv(qkv[:, :-12], rows.cos, rows.sin_signed, cache, cache.clone(), slots, 6)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.rope_store_kv(qkv, rows.cos, rows.sin_signed, cache, cache.clone(), torch.tensor([0, 8, 1], dtype=torch.int32), 6)
    with pytest.raises(RuntimeError, match="int32"):
        ops.rope_store_kv(qkv, rows.cos, rows.sin_signed, cache, cache.clone(), slots.long(), 6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.rope_store_kv(qkv, rows.cos, rows.sin_signed, cache.half(), cache.half(), slots, 6)
    assert torch.all(cache == 0)  # nothing written by a refused call


# ---- residual add + RMSNorm ---------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "delta_dtype", "fp32_out"), [
    (torch.float32, torch.float32, False),  # a float32 model
    (torch.bfloat16, torch.bfloat16, False),  # bf16 on a CPU with native bf16 GEMMs (and the final norm)
    (torch.bfloat16, torch.float32, True),  # bf16 via fp32 GEMMs (models/cpu_bf16.py): fp32 in and out
    (torch.bfloat16, torch.bfloat16, True),  # ... a one-row step's bf16 GEMV output
    (torch.bfloat16, None, True),  # the first layer: no residual yet
    (torch.float32, None, False),
])
@pytest.mark.parametrize("width", [72, 576, 13])
def test_add_rms_norm_against_the_torch_norm(ops, dtype, delta_dtype, fp32_out, width):
    torch.manual_seed(width)
    norm = RMSNorm(width, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width) + 1)
    norm.to(dtype)
    if fp32_out:
        norm.hand_fp32_out()
    residual = (torch.randn(37, width) * 4).to(dtype)
    # a strided delta: rows of a wider tensor, as a split would give
    delta = None if delta_dtype is None else (torch.randn(37, width + 5) * 2).to(delta_dtype)[:, :width]
    want_res = residual if delta is None else residual + delta.to(dtype)
    want = norm(want_res)
    got_res = residual.clone()
    got = ops.add_rms_norm(got_res, delta, norm.weight32 if fp32_out else norm.weight, norm.eps, fp32_out)
    assert torch.equal(got_res, want_res)  # the add: bit for bit, in place
    assert got.dtype == want.dtype == (torch.float32 if fp32_out else dtype) and got.shape == want.shape
    # the sum of squares in another order: its rsqrt within a few fp32 ulps, which a bf16 result
    # turns into at most one bf16 ulp
    assert ulps(got, want, got.dtype) <= (1 if got.dtype == torch.bfloat16 else 8)
    # and add_norm as the model calls it, with and without the op
    res_a, res_b = residual.clone(), residual.clone()
    op = layer_ops.add_rms_norm
    normed_a, res_a = op.forward_cpu(ops, delta, res_a, norm) if delta is not None else op.forward_cpu(ops, res_a, None, norm)
    normed_b, res_b = op.forward_native(delta, res_b, norm) if delta is not None else op.forward_native(res_b, None, norm)
    assert torch.equal(res_a, res_b) and torch.equal(normed_a, got) and torch.equal(normed_b, want)


def test_add_rms_norm_refuses_bad_inputs(ops):
    res = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="shapes differ"):
        ops.add_rms_norm(res, torch.zeros(4, 9), torch.ones(8), 1e-6, False)
    with pytest.raises(RuntimeError, match="weight"):
        ops.add_rms_norm(res, None, torch.ones(9), 1e-6, False)
    with pytest.raises(RuntimeError, match="bf16 delta for an fp32 residual"):
        ops.add_rms_norm(res, torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6, False)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.add_rms_norm(res.half(), None, torch.ones(8).half(), 1e-6, False)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.add_rms_norm(torch.zeros(8, 4).t(), None, torch.ones(8), 1e-6, False)


# ---- SiLU x up ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [136, 1536, 5])
def test_silu_mul_against_torch(ops, dtype, width):
    torch.manual_seed(width)
    gate_up = (torch.randn(19, 2 * width) * 6).to(dtype)
    gate_up[0, :6] = torch.tensor([-100.0, 100.0, 0.0, -0.0, -88.5, 88.5])  # exp under- and overflow, zero
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    # fp32: the polynomial exp's ~1 ulp, through x / (1 + e) and the product
    assert ulps(got, want, dtype) <= (1 if dtype == torch.bfloat16 else 8)
    assert ops.silu_mul(gate_up[:0]).shape == (0, width)


# ---- greedy sampling's argmax -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 5), (3, 256), (16, 300), (4, 49159), (1, 140000), (2, 200003)])
def test_argmax_rows_is_torchs_argmax(ops, dtype, rows, width):
    """The first maximum on ties, the first NaN where a row has one, an all -inf row's first index;
    values placed in different runs of 256 and in different pieces of a row split over threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # rows of 140,000 values and more are split in pieces
    try:
        g = torch.Generator().manual_seed(rows * width)
        for trial in range(6):
            x = torch.randint(-3, 3, (rows, width), generator=g).float() if trial % 2 else torch.randn(rows, width, generator=g)
            at = lambda: int(torch.randint(0, width, (1,), generator=g))  # noqa: E731
            for r in range(rows):
                kind = (r + trial) % 6
                if kind == 0:
                    x[r, at()] = float("nan")
                    x[r, at()] = float("nan")
                elif kind == 1:
                    x[r, at()] = float("inf")
                elif kind == 2:
                    x[r] = float("-inf")
                elif kind == 3:
                    x[r, at()] = x[r, at()] = 50.0  # a tie of the largest
                elif kind == 4:
                    x[r, at()] = float("-inf")
            case = x.to(dtype)
            got = ops.argmax_rows(case)
            assert got.dtype == torch.int64 and got.tolist() == case.float().argmax(-1).tolist(), (trial, r)
    finally:
        torch.set_num_threads(threads)


def test_argmax_rows_across_pieces(ops):
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        x = torch.zeros(3, 200000)
        x[0, 10], x[0, 150000] = 5.0, 5.0  # the same maximum in the first and the last piece: the first
        x[1, 10], x[1, 150000] = 5.0, float("nan")  # a NaN in a later piece beats a larger value before it
        x[2, 120000], x[2, 190000] = float("nan"), float("nan")
        assert ops.argmax_rows(x).tolist() == [10, 150000, 120000] == x.argmax(-1).tolist()
        assert ops.argmax_rows(torch.tensor([[-0.0, 0.0, -1.0], [0.0, -0.0, -1.0]])).tolist() == [0, 0]
    finally:
        torch.set_num_threads(threads)


def test_argmax_rows_refuses_bad_inputs(ops):
    assert ops.argmax_rows(torch.zeros(0, 7)).shape == (0,)
    with pytest.raises(RuntimeError, match="at least one value"):
        ops.argmax_rows(torch.zeros(3, 0))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.argmax_rows(torch.zeros(3, 4).half())
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.argmax_rows(torch.zeros(8, 4)[:, ::2])
    with pytest.raises(RuntimeError, match="2-D"):
        ops.argmax_rows(torch.zeros(8))


# ---- a whole forward ----------------------------------------------------------------------------
class CountingOps:
    """The compiled module, counting the calls of each op."""

    def __init__(self, ops) -> None:
        self.ops, self.calls = ops, {}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.ops, name)(*args)
        return call


def _forward(model: LlamaForCausalLM, dtype: torch.dtype, native: bool, q_lens=(9, 5, 1, 1),
             seq_lens=(9, 11, 7, 20)) -> tuple[torch.Tensor, list]:
    """By default a prefill of 9 tokens, a chunk of 5 more tokens over 6 cached, and two decodes, in
    one batch; returns the last hidden rows and the caches."""
    cfg, block_size = model.config, 4
    tables = torch.full((len(q_lens), 6), -1, dtype=torch.int32)
    slots, positions, next_block = [], [], 0
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        num = -(-seq_len // block_size)
        tables[s, :num] = torch.arange(next_block, next_block + num)
        next_block += num
        for pos in range(seq_len - q_len, seq_len):
            positions.append(pos)
            slots.append(int(tables[s, pos // block_size]) * block_size + pos % block_size)
    g = torch.Generator().manual_seed(7)
    caches = [tuple(torch.randn(next_block, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g).to(dtype)
                    for _ in range(2)) for _ in range(cfg.num_layers)]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             slot_mapping=torch.tensor(slots, dtype=torch.int32), max_query_len=max(q_lens),
                             max_seq_len=max(seq_lens))
    ids = torch.randint(cfg.vocab_size, (starts[-1],), generator=g)
    with mock.patch.dict(os.environ, {cpu_native.NATIVE_ENV: "1" if native else "0"}), torch.inference_mode():
        hidden = model(ids, torch.tensor(positions), meta, caches)
    return hidden, caches


def _model(form: str) -> tuple[LlamaForCausalLM, torch.dtype]:
    """The test model with random weights: float32, bf16 (native bf16 GEMMs: torch's, or the AMX
    tiles' where the CPU has AMX), or bf16 with fp32 GEMMs on its values (models/cpu_bf16.py)."""
    torch.manual_seed(0)
    # the AMX forms' MLP in whole 16-row panels, so that gate_up can fuse SiLU x up (Tiles(silu=True))
    model = LlamaForCausalLM(config(qkv_bias=True, **({"intermediate_size": 144} if "amx" in form else {})), 64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    dtype = torch.float32 if form == "float32" else torch.bfloat16
    model.to(dtype)
    model.rotary.float()
    if form == "bf16-via-fp32":
        use_fp32_gemms_for_bf16(model)
    if form in ("bf16-amx", "bf16-amx-silu"):
        native = cpu_native.load()
        if native is None or not native.amx_available():
            pytest.skip("no AMX-BF16 on this CPU: bf16 layers keep F.linear")
        assert layers.pack_cpu_linears(model) > 0 and model.layers[0].mlp.down_proj.tiles is not None
        if form == "bf16-amx-silu":
            assert model.fuse_silu() == model.config.num_layers
    return model, dtype


@pytest.mark.parametrize("form", ["float32", "bf16-native-gemms", "bf16-via-fp32", "bf16-amx"])
def test_a_forward_with_the_ops_matches_the_torch_code(ops, form):
    model, dtype = _model(form)
    cfg = model.config
    counting = CountingOps(ops)
    with mock.patch.dict(cpu_native._state, {"module": counting}):
        with_ops, caches_a = _forward(model, dtype, native=True)
    layers = cfg.num_layers  # every layer took the ops: two norms each and the final one
    assert counting.calls == {"add_rms_norm": 2 * layers + 1, "rope_store_kv": layers, "silu_mul": layers,
                              "decode_attention": layers}
    plain, caches_b = _forward(model, dtype, native=False)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(with_ops.float(), plain.float(), atol=tol, rtol=tol)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        torch.testing.assert_close(ka.float(), kb.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(va.float(), vb.float(), atol=tol, rtol=tol)


# ---- the direct GEMM path ----------------------------------------------------------------------
def _packed_model(form: str, monkeypatch) -> tuple[LlamaForCausalLM, torch.dtype]:
    """The test model with oneDNN copies of every linear (the tiny layers are below the size rule)."""
    monkeypatch.setattr(layers, "PACK_MIN_WEIGHTS", 0)
    model, dtype = _model(form)  # bf16 via fp32 packs as it swaps the layers
    if form == "float32":
        assert layers.pack_cpu_linears(model) > 0
    return model, dtype


@pytest.mark.parametrize("form", ["float32", "bf16-via-fp32", "bf16-amx", "bf16-amx-silu"])
def test_the_direct_gemm_path_gives_the_module_path_bits(ops, form, monkeypatch):
    model, dtype = _packed_model(form, monkeypatch)
    direct_calls = []
    forward_direct = DecoderLayer.forward_direct
    monkeypatch.setattr(DecoderLayer, "forward_direct",
                        lambda self, *a: direct_calls.append(self) or forward_direct(self, *a))
    with mock.patch.dict(cpu_native._state, {"module": ops}):
        direct, caches_a = _forward(model, dtype, native=True)
        assert len(direct_calls) == model.config.num_layers  # every layer went straight to its GEMMs
        monkeypatch.setattr(DecoderLayer, "direct_gemms", lambda self, rows: None)
        model.forget_direct_gemms()  # the model keeps what its layers chose for a row count
        modules, caches_b = _forward(model, dtype, native=True)
    assert len(direct_calls) == model.config.num_layers  # the second forward took the module calls
    assert torch.equal(direct, modules)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("form", ["float32", "bf16-via-fp32", "bf16-amx", "bf16-amx-silu"])
def test_the_compiled_layer_loop_gives_the_python_layers_bits(ops, form, monkeypatch):
    # a step of decodes only: layers 1.. in one call (kernels/cpu_decode_step.cpp: decode_layers)
    model, dtype = _packed_model(form, monkeypatch)
    decodes = {"q_lens": (1, 1, 1), "seq_lens": (7, 20, 3)}
    counting = CountingOps(ops)
    with mock.patch.dict(cpu_native._state, {"module": counting}):
        compiled, caches_a = _forward(model, dtype, native=True, **decodes)
        assert counting.calls["decode_layers"] == 1
        assert counting.calls["decode_attention"] == 1  # the first layer's, from Python
        model.compiled_decode = False
        plain, caches_b = _forward(model, dtype, native=True, **decodes)
        assert counting.calls["decode_layers"] == 1 and counting.calls["decode_attention"] == 1 + model.config.num_layers
        model.compiled_decode = True
        _forward(model, dtype, native=True)  # prefill rows in the batch: the Python layers
        assert counting.calls["decode_layers"] == 1
    assert torch.equal(compiled, plain)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_the_fused_gate_up_gives_the_unfused_bits(ops, monkeypatch):
    # SiLU x up in the gate_up GEMM's epilogue: the same roundings as the GEMM then silu_mul
    fused, dtype = _packed_model("bf16-amx-silu", monkeypatch)
    plain, _ = _packed_model("bf16-amx", monkeypatch)
    assert fused.layers[0].mlp.gate_up_proj.tiles is None and plain.layers[0].mlp.gate_up_silu is None
    with mock.patch.dict(cpu_native._state, {"module": ops}):
        got, caches_a = _forward(fused, dtype, native=True)
        want, caches_b = _forward(plain, dtype, native=True)
    assert torch.equal(got, want)
    for (ka, va), (kb, vb) in zip(caches_a, caches_b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    h = torch.randn(layers.TILE_MAX_ROWS + 1, fused.config.hidden_size).bfloat16()
    mlp_f, mlp_p = fused.layers[0].mlp, plain.layers[0].mlp
    with mock.patch.dict(cpu_native._state, {"module": ops}):  # beyond the tiles' rows: F.linear, then silu_mul
        torch.testing.assert_close(mlp_f(h), mlp_p(h), atol=5e-2, rtol=2e-2)
    assert mlp_f.activation(layers.TILE_MAX_ROWS + 1) is None


def test_no_compiled_layer_loop_where_a_gemm_is_onednns(ops, monkeypatch):
    model, _ = _packed_model("float32", monkeypatch)  # fp32: oneDNN above the panels' 64 rows
    assert model.compiled_layers(4) is not None
    assert model.compiled_layers(layers.PANEL_MAX_ROWS + 1) is None
    model.layers[1].mlp.down_proj.tp_combine = lambda y: y  # a collective: no direct GEMM at all
    model.forget_direct_gemms()
    assert model.compiled_layers(4) is None


def test_the_model_chooses_its_layers_gemms_once_per_row_count(ops, monkeypatch):
    model, dtype = _packed_model("bf16-via-fp32", monkeypatch)
    chosen = []
    direct_gemms = DecoderLayer.direct_gemms
    monkeypatch.setattr(DecoderLayer, "direct_gemms", lambda self, rows: chosen.append(rows) or direct_gemms(self, rows))
    layers_n = model.config.num_layers
    with mock.patch.dict(cpu_native._state, {"module": ops}):
        first, _ = _forward(model, dtype, native=True)  # 16 rows
        again, _ = _forward(model, dtype, native=True)
        assert chosen == [16] * layers_n and torch.equal(first, again)
        model.forget_direct_gemms()
        _forward(model, dtype, native=True)
        assert chosen == [16] * (2 * layers_n)
    many = llama.DIRECT_GEMMS_KEPT_ROWS + 1
    model.layer_gemms(many)
    model.layer_gemms(many)
    assert chosen[2 * layers_n:] == [many] * (2 * layers_n)  # too many rows to keep
    assert model.layer_gemms(3) is model.layer_gemms(3) and len(model.layer_gemms(3)) == layers_n


def test_direct_gemms_only_where_the_module_call_is_that_gemm(monkeypatch):
    model, _ = _packed_model("bf16-via-fp32", monkeypatch)
    layer = model.layers[0]
    assert layer.direct_gemms(1) is not None and layer.direct_gemms(2) is not None  # the panels' GEMM
    layer.mlp.down_proj.panels = None  # no panels (no compiled ops): oneDNN from two rows
    assert layer.direct_gemms(2) is not None
    assert layer.direct_gemms(1) is None  # one row: the bf16 GEMV on the bf16 weights
    layer.mlp.down_proj.tp_combine = lambda y: y  # a collective after it (tensor parallelism)
    assert layer.direct_gemms(2) is None
    layer.mlp.down_proj.tp_combine = None
    layer.self_attn.o_proj.out_dtype = torch.bfloat16  # its output rounded: not what the GEMM gives
    assert layer.direct_gemms(2) is None
    fp32_model, _ = _packed_model("float32", monkeypatch)
    assert fp32_model.layers[0].direct_gemms(1) is not None  # fp32: oneDNN at one row too
    fp32_model.layers[0].self_attn.qkv_proj.packed = None  # no oneDNN copy: the panels up to 64 rows
    assert fp32_model.layers[0].direct_gemms(4) is not None and fp32_model.layers[0].direct_gemms(65) is None
    fp32_model.layers[0].self_attn.qkv_proj.panels = None  # neither: F.linear
    assert fp32_model.layers[0].direct_gemms(4) is None
