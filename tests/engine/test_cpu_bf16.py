import torch
from torch import nn

from pdserve.engine.models.cpu_bf16 import Bf16ViaFp32Linear, use_fp32_gemms_for_bf16


def test_matches_a_bf16_gemm_with_fp32_accumulation():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(7, 64).to(torch.bfloat16)
    got = Bf16ViaFp32Linear(lin)(x)
    # What a native bf16 GEMM computes: exact products of the bf16 values, fp32 sums, one rounding.
    want = (x.double() @ lin.weight.double().T + lin.bias.double()).float().to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want) or (got.float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    ref = lin(x)  # torch's own bf16 linear agrees to bf16 precision
    assert torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_swaps_every_linear():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2, bias=False))).to(torch.bfloat16)
    assert use_fp32_gemms_for_bf16(model) == 2
    assert all(not isinstance(m, nn.Linear) for m in model.modules())
    assert model(torch.ones(1, 4, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_one_row_reads_the_bf16_weights_and_agrees_with_the_rows_of_a_batch():
    """A single stream's step is a GEMV: it runs on the bf16 weights (shared, not copied) and sums
    in fp32 like the fp32 GEMM of several rows, so a row differs from its batched self by the
    summation order's rounding only (at most one bf16 ulp)."""
    torch.manual_seed(1)
    lin = nn.Linear(256, 384, bias=True).to(torch.bfloat16)
    layer = Bf16ViaFp32Linear(lin)
    assert layer.weight16.data_ptr() == lin.weight.data_ptr()
    x = torch.randn(5, 256).to(torch.bfloat16)
    batch = layer(x)
    exact = (x.double() @ lin.weight.double().T + lin.bias.double())
    for i in range(5):
        one = layer(x[i : i + 1])
        assert one.dtype == torch.bfloat16 and one.shape == (1, 384)
        ulp = 2.0 ** (torch.floor(torch.log2(exact[i].abs().float().clamp_min(1e-30))) - 7)
        assert ((one[0].float() - batch[i].float()).abs() <= ulp).all()
        assert ((one[0].double() - exact[i]).abs() <= ulp.double()).all()
    # fp32 in (a norm's hand-off) and fp32 out (gate_up's hand-off) on the one-row path too
    layer.out_dtype = torch.float32
    y = layer(x[:1].float())
    ulp = 2.0 ** (torch.floor(torch.log2(exact[0].abs().float().clamp_min(1e-30))) - 7)
    assert y.dtype == torch.float32 and ((y[0].double() - exact[0]).abs() <= ulp.double()).all()
