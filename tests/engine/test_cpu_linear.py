"""oneDNN weight copies on the CPU (engine/ops/linear.py: cpu_linear, pack_cpu_linears)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.models.cpu_bf16 import Bf16ViaFp32Linear
from pdserve.engine.ops import linear as layers
from pdserve.engine.ops.linear import PACK_MIN_WEIGHTS, pack_cpu_linears
from pdserve.engine.parallel.layers import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    # the same fp32 products, summed in another order
    return torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows", [0, 1, 2, 16, 37])
def test_every_big_enough_layer_is_packed_and_computes_x_wt_at_any_number_of_rows(rows):
    torch.manual_seed(rows)
    model = nn.Sequential(
        ColumnParallelLinear(384, [(0, 384, 384), (0, 384, 384)], bias=True),  # 294,912 weights, 2 parts
        RowParallelLinear((0, 768, 768), 384, 1),  # narrow (out < in), as down_proj: packed too
        ColumnParallelLinear(64, [(0, 192, 192)], bias=False),  # 12,288 weights: below the threshold
    )
    assert pack_cpu_linears(model) == 2
    big, narrow, small = model
    assert big.packed is not None and narrow.packed is not None and small.packed is None
    for layer, width in ((big, 384), (narrow, 768), (small, 64)):
        x = torch.randn(rows, width)
        got = layer(x)
        want = F.linear(x, layer.weight, layer.bias)
        assert got.shape == (rows, layer.out_features) and _close(got, want)


@pytest.mark.timeout(60)
def test_the_threshold_is_where_the_copy_starts():
    w = torch.randn(PACK_MIN_WEIGHTS // 128, 128)
    assert layers.onednn_packed_weight(w) is not None
    assert layers.onednn_packed_weight(w[:-1]) is None
    assert layers.onednn_packed_weight(w.to(torch.bfloat16)) is None  # fp32 weights only


@pytest.mark.timeout(60)
def test_a_packed_bf16_layer_keeps_no_fp32_weight_and_matches_a_bf16_gemm():
    """A bf16 model's layer on a CPU without native bf16: with the oneDNN copy it holds the bf16
    weight (one row) and the copy (several rows), not a third, fp32, copy; results as before."""
    torch.manual_seed(3)
    lin = nn.Linear(512, 384, bias=False).to(torch.bfloat16)
    layer = Bf16ViaFp32Linear(lin)
    assert layer.packed is not None and layer.weight32 is None
    small = Bf16ViaFp32Linear(nn.Linear(64, 32).to(torch.bfloat16))
    assert small.packed is None and small.weight32 is not None
    for rows in (0, 1, 5):
        x = torch.randn(rows, 512).to(torch.bfloat16)
        got = layer(x)
        exact = (x.double() @ lin.weight.double().T).float()
        # one bf16 rounding of the fp32 sum: within a bf16 ulp of the exact value
        ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 384)
        assert ((got.float() - exact).abs() <= ulp).all()
