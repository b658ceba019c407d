"""bfloat16 linear layers on CPUs without native bf16 matmuls (no AVX512-BF16 / AMX).

There, torch's bf16 GEMM falls back to a slow path (several times slower than fp32), while a native
bf16 GEMM (oneDNN with AVX512-BF16, a GPU's tensor cores) multiplies bf16 inputs exactly and
accumulates in fp32. This layer does the same math with an fp32 GEMM: the weights are bf16 values
held in fp32 (products of bf16 values are exact in fp32), the activations are bf16 values widened
to fp32, the sum accumulates in fp32, and the output is rounded back to bf16. The residual stream,
attention and the KV cache stay bf16; a norm's output and the MLP's activation go to their GEMM in
fp32 (`hand_fp32_to_gemms`). Several rows run the CPU's fastest fp32 GEMM (engine/ops/linear.py:
`cpu_linear`) on a oneDNN copy of the fp32 weight; a layer too small for the copy keeps the fp32
weight itself for F.linear.

A few rows (1 to linear.PANEL_MAX_ROWS: decode batches) run pdserve's own GEMM on the bf16 weights,
packed once in 16-column panels (kernels/cpu_gemm.cpp: gemm_panels), where the compiled ops load:
half the bytes of the fp32 copy, fp32 sums in k order (a row gets the same bits in any batch).
Without the compiled ops one row runs torch's bf16 GEMV on the bf16 weights, which also sums in
fp32 and rounds once. The layer keeps the bf16 weights, the panels and the oneDNN copy: 2x the fp32
layer's memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.ops.linear import cpu_linear, direct_gemm, onednn_packed_weight
from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_gemm import Panels


class Bf16ViaFp32Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        # bf16-rounded values in fp32: the GEMM sees exactly the bf16 weights. Packed for oneDNN when
        # big enough (then the fp32 weight itself is not kept: only F.linear would read it).
        weight32 = linear.weight.detach().to(torch.bfloat16).float()
        self.packed = onednn_packed_weight(weight32)
        self.register_buffer("weight32", weight32 if self.packed is None else None, persistent=False)
        bias = linear.bias
        self.register_buffer("bias32", None if bias is None else bias.detach().to(torch.bfloat16).float(),
                             persistent=False)
        # for one-row calls; a tied lm_head shares the embedding's tensor (no copy when already bf16)
        self.register_buffer("weight16", linear.weight.detach().to(torch.bfloat16), persistent=False)
        self.register_buffer("bias16", None if bias is None else bias.detach().to(torch.bfloat16),
                             persistent=False)
        # the bf16 weights packed for the compiled few-row GEMM, beside a oneDNN copy (none without
        # the compiled ops: PDSERVE_CPU_NATIVE=0, no compiler)
        native = cpu_native.load() if self.packed is not None else None
        self.panels = None if native is None else Panels(native, self.weight16)
        self.out_features = weight32.shape[0]
        # float32 where the output feeds only another fp32 GEMM; None where the consumer rounds to
        # bf16 itself: the GEMM's own output then (fp32 for several rows, bf16 from the GEMV)
        self.out_dtype: torch.dtype | None = torch.bfloat16
        # a tensor-parallel layer's collective (engine/parallel/layers.py), kept across the swap
        self.tp_combine = getattr(linear, "tp_combine", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= x.shape[-1] and (self.panels is None or x.dim() != 2 or x.numel() == 0):
            # one row off the panels (or no row): torch's GEMV over the bf16 weights
            y = F.linear(x.to(torch.bfloat16), self.weight16, self.bias16)
        else:  # the panels up to linear.PANEL_MAX_ROWS rows, else oneDNN (cpu_linear chooses)
            # (a no-op conversion still costs a call)
            packed = self.packed
            y = cpu_linear(x if x.dtype == torch.float32 else x.float(), None if packed is not None else self.weight32,
                           self.bias32, packed, self.panels)
        if self.out_dtype is not None and y.dtype != self.out_dtype:
            y = y.to(self.out_dtype)
        return y if self.tp_combine is None else self.tp_combine(y)

    def direct_gemm(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """linear.direct_gemm, where the fp32 output is handed on: the panels' GEMM up to
        linear.PANEL_MAX_ROWS rows, else oneDNN's from two rows (one row without panels is the GEMV)."""
        if self.out_dtype not in (None, torch.float32) or (rows == 1 and self.panels is None):
            return None
        return direct_gemm(self.packed, self.bias32, rows, self.tp_combine, self.panels)


def use_fp32_gemms_for_bf16(model: nn.Module) -> int:
    """Swap every nn.Linear of a bf16 CPU model for Bf16ViaFp32Linear, then let the modules that
    can (`hand_fp32_to_gemms`: engine/models/llama.py) pass fp32 between them; returns how many."""
    swapped = 0
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Bf16ViaFp32Linear(child))
                swapped += 1
    for module in model.modules():
        if hasattr(module, "hand_fp32_to_gemms"):
            module.hand_fp32_to_gemms()
    return swapped
