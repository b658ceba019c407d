"""Ops with one implementation per device, as vLLM's CustomOp: `forward_native` (plain torch, the
reference), `forward_cpu` (the compiled CPU kernels: kernels/cpu_native.py), `forward_cuda` (torch
or Triton on a GPU; forward_native unless an op has its own).

Calling an op runs the method of its first tensor's device. On a CPU that is forward_cpu where the
compiled module loads and the op takes the input (`cpu_takes`: float32 or bf16 by default), else
forward_native: the module is looked up on every call (a dict lookup once built), so a build that
failed, PDSERVE_CPU_NATIVE=0 or a benchmark switching it between steps (benchmarks/decode_kernel_ab.py)
falls back to the torch code without rebuilding the model. forward_cpu gets the module first.
"""

from __future__ import annotations

import abc

import torch

from pdserve.kernels import cpu_native


class CustomOp(abc.ABC):
    __slots__ = ()

    def __call__(self, x: torch.Tensor, *args, **kwargs):
        device = x.device.type
        if device == "cpu":
            module = cpu_native.load() if self.cpu_takes(x, *args) else None
            if module is not None:
                return self.forward_cpu(module, x, *args, **kwargs)
        elif device == "cuda":
            return self.forward_cuda(x, *args, **kwargs)
        return self.forward_native(x, *args, **kwargs)

    def cpu_takes(self, x: torch.Tensor, *args) -> bool:
        return x.dtype in cpu_native.DTYPES

    @abc.abstractmethod
    def forward_native(self, *args, **kwargs):
        """The plain torch reference every op defines."""

    def forward_cpu(self, module, *args, **kwargs):
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args, **kwargs):
        return self.forward_native(*args, **kwargs)
