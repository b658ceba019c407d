"""The compiled few-row GEMM on bf16 or fp32 weights (kernels/cpu_gemm.cpp: pack_panels,
gemm_panels) and the layers that use it (engine/models/cpu_bf16.py, engine/ops/linear.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models import cpu_bf16
from pdserve.engine.ops import linear as layers
from pdserve.engine.parallel.layers import ColumnParallelLinear
from pdserve.kernels import cpu_native


@pytest.fixture(scope="module")
def ops():
    module = cpu_native.load()
    if module is None:
        pytest.skip("the compiled CPU ops are not built here (no compiler)")
    return module


def reference(x: torch.Tensor, w16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w16.double().T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize(("rows", "out_features", "in_features"),
                         [(1, 16, 8), (2, 17, 24), (3, 15, 40), (5, 40, 1), (6, 33, 576), (7, 1, 9),
                          (13, 48, 64), (16, 960, 576), (64, 100, 96),
                          # one and two rows over groups of 4 panels, a group's leftovers, a partial last panel
                          (1, 16 * 9 + 5, 64), (1, 16 * 8, 33), (2, 16 * 7 + 1, 48), (3, 16 * 6, 20), (1, 3, 7),
                          (1, 16 * 12 + 3, 40), (1, 16 * 6, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_the_panel_gemm_against_a_float64_product(ops, rows, out_features, in_features, with_bias, weight_dtype):
    # rows around the 6/4/2/1-row blocking, widths around the 16-column panels and the 4-panel
    # groups and their leftovers (in twos, then one; with 2 threads a half of the panels can end
    # inside a group), any depth
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w16 = torch.randn(out_features, in_features, generator=g).to(weight_dtype)
    x = torch.randn(rows, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    panels = ops.pack_panels(w16)
    assert panels.shape == (-(-out_features // 16), in_features, 16) and panels.dtype == weight_dtype
    got = ops.gemm_panels(x, panels, out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    want = reference(x, w16, bias)
    # fp32 sums in k order: a few ulps of the sum of |terms|
    scale = (x.double().abs() @ w16.double().abs().T) + (0 if bias is None else bias.double().abs())
    assert torch.all((got.double() - want).abs() <= 1e-6 * in_features * scale + 1e-30)


def test_the_panel_gemm_refuses_what_does_not_fit(ops):
    w16 = torch.randn(20, 8).bfloat16()
    panels = ops.pack_panels(w16)
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match="x must be 2-D float32 or bfloat16"):
        ops.gemm_panels(x.double(), panels, 20, None)
    with pytest.raises(RuntimeError, match="x must be 2-D float32 or bfloat16"):
        ops.gemm_panels(x[None], panels, 20, None)
    with pytest.raises(RuntimeError, match="panels must be"):
        ops.gemm_panels(torch.randn(3, 9), panels, 20, None)  # another depth
    with pytest.raises(RuntimeError, match="panels must be"):
        ops.gemm_panels(x, panels, 40, None)  # more columns than packed
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.gemm_panels(x, panels, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="a 2-D bfloat16 or float32 weight"):
        ops.pack_panels(torch.randn(4, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="a 2-D bfloat16 or float32 weight"):
        ops.pack_panels(torch.randn(4).bfloat16())


def test_the_panel_gemm_widens_bf16_rows_first(ops):
    # a bf16 model's attention output goes to its o_proj as it is (models/llama.py: forward_direct)
    w16 = torch.randn(40, 24).bfloat16()
    panels = ops.pack_panels(w16)
    x = torch.randn(5, 24).bfloat16()
    assert torch.equal(ops.gemm_panels(x, panels, 40, None), ops.gemm_panels(x.float(), panels, 40, None))


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_a_row_gets_the_same_bits_in_any_batch(ops, weight_dtype):
    # each output sums its products in k order whatever the rows around it: batch-invariant
    # (one and two rows work on several panels at once, more rows on one: the same sums)
    w16 = torch.randn(200, 576).to(weight_dtype)
    panels = ops.pack_panels(w16)
    x = torch.randn(13, 576)
    batch = ops.gemm_panels(x, panels, 200, None)
    for i in range(13):
        assert torch.equal(ops.gemm_panels(x[i : i + 1], panels, 200, None)[0], batch[i])
    for i in range(0, 12, 2):
        assert torch.equal(ops.gemm_panels(x[i : i + 2], panels, 200, None), batch[i : i + 2])


def test_a_bf16_layer_takes_the_panels_for_a_few_rows_and_onednn_for_more(ops, monkeypatch):
    monkeypatch.setattr(layers, "PACK_MIN_WEIGHTS", 0)
    torch.manual_seed(0)
    linear = nn.Linear(40, 50, bias=True)
    layer = cpu_bf16.Bf16ViaFp32Linear(linear)
    assert layer.packed is not None and layer.panels is not None
    layer.out_dtype = torch.float32
    calls = []
    real = layer.panels.gemm
    layer.panels.gemm = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    w16, b16 = linear.weight.detach().bfloat16(), linear.bias.detach().bfloat16()
    for rows in (1, 2, layers.PANEL_MAX_ROWS, layers.PANEL_MAX_ROWS + 1):
        x = torch.randn(rows, 40).bfloat16()
        got = layer(x)
        want = F.linear(x.float(), w16.float(), b16.float())
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert calls == [1, 2, layers.PANEL_MAX_ROWS]  # the 65-row call ran oneDNN
    # its direct GEMM (DecoderLayer.forward_direct) is the same call
    x = torch.randn(5, 40)
    assert torch.equal(layer.direct_gemm(5)(x), layer(x))
    with mock.patch.dict("os.environ", {cpu_native.NATIVE_ENV: "0"}):  # ops off: no panels, oneDNN
        assert cpu_bf16.Bf16ViaFp32Linear(linear).panels is None


def test_an_fp32_layer_takes_the_panels_for_a_few_rows_and_onednn_for_more(ops, monkeypatch):
    monkeypatch.setattr(layers, "PACK_MIN_WEIGHTS", 0)
    torch.manual_seed(0)
    model = nn.Sequential(ColumnParallelLinear(40, [(0, 50, 50)], bias=True))
    layer = model[0]
    assert layers.pack_cpu_linears(model) == 1 and layer.packed is not None and layer.panels is not None
    assert layer.panels.panels.dtype == torch.float32
    calls = []
    real = layer.panels.gemm
    layer.panels.gemm = lambda *a: calls.append(a[0].shape[0]) or real(*a)
    for rows in (1, 2, layers.PANEL_MAX_ROWS, layers.PANEL_MAX_ROWS + 1):
        x = torch.randn(rows, 40)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert calls == [1, 2, layers.PANEL_MAX_ROWS]  # the 65-row call ran oneDNN
    x = torch.randn(5, 40)
    assert torch.equal(layer.direct_gemm(5)(x), layer(x))
    assert layer.direct_gemm(layers.PANEL_MAX_ROWS + 1) is not None  # oneDNN's, from the copy
    with mock.patch.dict("os.environ", {cpu_native.NATIVE_ENV: "0"}):
        layers.pack_cpu_linears(model)  # ops off: oneDNN at every row count
    assert layer.panels is None and layer.packed is not None
