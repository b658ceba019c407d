"""The AMX bf16 GEMM (kernels/cpu_amx.cpp: pack_tiles, gemm_tiles) and the bf16 layers that use it
(kernels/cpu_gemm.py: Tiles; engine/ops/linear.py: cpu_linear). Skipped on CPUs without AMX-BF16; there a bf16
layer keeps F.linear, which the model tests cover."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.ops import linear as layers
from pdserve.engine.parallel.layers import ColumnParallelLinear
from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_gemm import Tiles


@pytest.fixture(scope="module")
def ops():
    module = cpu_native.load()
    if module is None:
        pytest.skip("the compiled CPU ops are not built here (no compiler)")
    if not module.amx_available():
        pytest.skip("this CPU (or its kernel) gives no AMX-BF16: bf16 layers run F.linear")
    return module


def test_amx_available_answers_without_amx_too():
    module = cpu_native.load()
    if module is None:
        pytest.skip("the compiled CPU ops are not built here (no compiler)")
    flags = open("/proc/cpuinfo").read().split() if __import__("os").path.exists("/proc/cpuinfo") else []
    if "amx_bf16" not in flags:
        assert module.amx_available() is False
    else:
        assert isinstance(module.amx_available(), bool)


@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 16, 32), (1, 960, 576), (2, 17, 24), (3, 15, 40), (7, 1, 9), (16, 64, 64),
                          (17, 100, 96), (31, 33, 576), (32, 48, 64), (33, 80, 100), (64, 3 * 16 + 5, 160),
                          (65, 16, 32), (130, 40, 96), (5, 16 * 9 + 5, 1536),
                          (512, 16 * 3 + 5, 1536), (300, 96, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_bf16", [True, False])
def test_the_tile_gemm_against_a_float64_product(ops, rows, out_features, in_features, with_bias, out_bf16):
    # rows around the 16-row tiles and their pairs, widths around the 16-column panels and the
    # 4- and 2-panel groups, depths around the 32 of a tile; a prefill's rows, whose blocks are
    # stored during the next block's tile steps (cpu_amx.cpp: Epilogue), one row a step at 48 k tiles
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    bias = torch.randn(out_features, generator=g).bfloat16() if with_bias else None
    tiles = ops.pack_tiles(w)
    assert tiles.shape == (-(-out_features // 16), -(-in_features // 32), 512) and tiles.dtype == torch.bfloat16
    got = ops.gemm_tiles(x, tiles, out_features, bias, out_bf16)
    assert got.shape == (rows, out_features)
    assert got.dtype == (torch.bfloat16 if out_bf16 else torch.float32)
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # fp32 sums: a few ulps of the sum of |terms|; then one rounding to bf16 (half a bf16 ulp)
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    bound = 1e-6 * in_features * scale + 1e-30
    if out_bf16:
        bound = bound + 2.0**-8 * want.abs()
    assert torch.all((got.double() - want).abs() <= bound)


def test_a_row_gets_the_same_bits_in_any_batch(ops):
    # each output sums in k order, tile by tile, whatever the rows around it
    w = torch.randn(200, 576).bfloat16()
    tiles = ops.pack_tiles(w)
    x = torch.randn(40, 576).bfloat16()
    batch = ops.gemm_tiles(x, tiles, 200, None, True)
    for i in range(40):
        assert torch.equal(ops.gemm_tiles(x[i : i + 1], tiles, 200, None, True)[0], batch[i])
    assert torch.equal(ops.gemm_tiles(x[3:20], tiles, 200, None, True), batch[3:20])


def test_the_tile_gemm_takes_strided_rows_and_no_rows(ops):
    w = torch.randn(48, 64).bfloat16()
    tiles = ops.pack_tiles(w)
    wide = torch.randn(5, 128).bfloat16()
    x = wide[:, 32:96]  # rows 128 apart
    assert torch.equal(ops.gemm_tiles(x, tiles, 48, None, True), ops.gemm_tiles(x.contiguous(), tiles, 48, None, True))
    assert ops.gemm_tiles(x[:0], tiles, 48, None, True).shape == (0, 48)


def test_the_tile_gemm_refuses_what_does_not_fit(ops):
    w = torch.randn(20, 40).bfloat16()
    tiles = ops.pack_tiles(w)
    x = torch.randn(3, 40).bfloat16()
    with pytest.raises(RuntimeError, match="x must be 2-D bfloat16"):
        ops.gemm_tiles(x.float(), tiles, 20, None, True)
    with pytest.raises(RuntimeError, match="tiles must be"):
        ops.gemm_tiles(torch.randn(3, 72).bfloat16(), tiles, 20, None, True)  # another depth
    with pytest.raises(RuntimeError, match="tiles must be"):
        ops.gemm_tiles(x, tiles, 40, None, True)  # more columns than packed
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.gemm_tiles(x, tiles, 20, torch.randn(19), True)
    with pytest.raises(RuntimeError, match="a 2-D bfloat16 weight"):
        ops.pack_tiles(torch.randn(4, 4))


def test_a_bf16_layer_takes_the_tiles_up_to_their_rows_and_f_linear_beyond(ops):
    torch.manual_seed(0)
    model = nn.Sequential(ColumnParallelLinear(40, [(0, 50, 50)], bias=True)).bfloat16()
    layer = model[0]
    assert layers.pack_cpu_linears(model) == 1 and layer.tiles is not None
    assert layer.packed is None and layer.panels is None  # no oneDNN copy of a bf16 weight
    calls = []
    real = layer.tiles.gemm
    layer.tiles.gemm = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    for rows in (1, 2, 16, layers.TILE_MAX_ROWS, layers.TILE_MAX_ROWS + 1):
        x = torch.randn(rows, 40).bfloat16()
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=3e-2, rtol=1e-2)
    assert calls == [1, 2, 16, layers.TILE_MAX_ROWS]  # the last call ran F.linear
    x = torch.randn(5, 40).bfloat16()
    assert torch.equal(layer.direct_gemm(5)(x), layer(x))
    assert layer.direct_gemm(layers.TILE_MAX_ROWS + 1) is None  # F.linear: the module call


def test_no_tiles_for_fp32_or_without_amx(ops, monkeypatch):
    model = nn.Sequential(ColumnParallelLinear(40, [(0, 50, 50)], bias=False))
    layers.pack_cpu_linears(model)
    assert model[0].tiles is None  # an fp32 layer: oneDNN and the panels (test_cpu_gemm.py)
    monkeypatch.setattr(cpu_native, "load", lambda: None)  # no compiled ops
    model.bfloat16()
    assert layers.pack_cpu_linears(model) == 0 and model[0].tiles is None


@pytest.mark.parametrize(("rows", "inter", "depth"), [(1, 16, 32), (3, 48, 40), (16, 64, 64), (17, 32, 100),
                                                     (40, 1536, 576), (130, 80, 96)])
def test_the_fused_gate_up_gives_the_gemm_then_silu_mul(ops, rows, inter, depth):
    g = torch.Generator().manual_seed(rows + inter)
    w = (torch.randn(2 * inter, depth, generator=g) * 0.3).bfloat16()  # gate rows, then up rows
    x = torch.randn(rows, depth, generator=g).bfloat16()
    fused = Tiles(ops, w, silu=True)
    assert fused(x).shape == (rows, inter)
    assert torch.equal(fused(x), ops.silu_mul(Tiles(ops, w)(x)))


def test_the_fused_gate_up_refuses_what_it_cannot_pair(ops):
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        Tiles(ops, torch.randn(2 * 24, 32).bfloat16(), silu=True)
    tiles = ops.pack_tiles(torch.randn(48, 32).bfloat16())  # 3 panels: no (gate, up) pairs
    with pytest.raises(RuntimeError, match="interleaved"):
        ops.gemm_tiles_silu(torch.randn(2, 32).bfloat16(), tiles, 48)
