"""Greedy sampling's argmax of each row of logits."""

from __future__ import annotations

import torch

from pdserve.engine.ops.custom_op import CustomOp
from pdserve.kernels import cpu_native


class ArgmaxRows(CustomOp):
    """[S] int64: each row's argmax, the first on ties and a NaN's index where a row has one, as
    torch's. On the CPU the compiled op (kernels/cpu_elementwise.cpp: argmax_rows) reads float32 or
    bf16 rows as they are, on every thread; without it, numpy's argmax on a float copy: torch's
    argmax over the last dim is not vectorised on the CPU."""

    __slots__ = ()

    def cpu_takes(self, logits: torch.Tensor) -> bool:
        return (logits.dim() == 2 and logits.dtype in cpu_native.DTYPES and logits.stride(1) == 1
                and logits.shape[1] > 0)

    def forward_native(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.device.type != "cpu" or logits.dim() != 2:
            return logits.argmax(-1)
        return torch.from_numpy((logits if logits.dtype == torch.float64 else logits.float()).numpy().argmax(1))

    def forward_cpu(self, module, logits: torch.Tensor) -> torch.Tensor:
        return module.argmax_rows(logits)

    def forward_cuda(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)


argmax_rows = ArgmaxRows()
