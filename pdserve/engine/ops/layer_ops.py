"""A decoder layer's elementwise ops: the residual add with RMSNorm and SiLU x up. On a CPU each runs
as one compiled call (kernels/cpu_elementwise.cpp) instead of several torch ops; that file says what
is bit for bit the same as forward_native and what differs in the last bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.ops.custom_op import CustomOp
from pdserve.kernels import cpu_native


class AddRMSNorm(CustomOp):
    """(norm(r), r) with r = residual + x rounded to the residual's dtype, or r = x when there is no
    residual yet (the first layer). `norm` is the model's RMSNorm: its weight (or fp32 weight32 when
    it hands fp32 on) and eps. The compiled op updates the residual in place."""

    __slots__ = ()

    def cpu_takes(self, x, residual, norm) -> bool:
        return (x if residual is None else residual).dtype in cpu_native.DTYPES

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None, norm) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x if residual is None else residual + x.to(residual.dtype)
        return norm(residual), residual

    def forward_cpu(self, module, x, residual, norm) -> tuple[torch.Tensor, torch.Tensor]:
        fp32_out = norm.weight32 is not None
        if residual is None:
            residual, x = x, None
        return module.add_rms_norm(residual, x, norm.weight32 if fp32_out else norm.weight, norm.eps,
                                   fp32_out), residual


class SiluMul(CustomOp):
    """silu(gate) * up of [T, 2I] rows (gate | up): [T, I] in the input's dtype."""

    __slots__ = ()

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, module, gate_up: torch.Tensor) -> torch.Tensor:
        return module.silu_mul(gate_up)


add_rms_norm = AddRMSNorm()
silu_mul = SiluMul()
