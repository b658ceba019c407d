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
