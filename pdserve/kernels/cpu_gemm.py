"""The compiled CPU GEMMs' packed weights, as callables (kernels/cpu_gemm.cpp, kernels/cpu_amx.cpp),
and oneDNN's GEMM on a reordered weight copy. Which GEMM a layer runs at how many rows is the
engine's choice (engine/ops/linear.py: cpu_linear)."""

from __future__ import annotations

import torch

# the rows oneDNN tunes a reordered weight's layout for; any number of rows runs on it
PACK_BATCH_HINT = 16


class Panels:
    """A weight [N, K] (bf16 or fp32) packed in 16-column panels for the compiled few-row GEMM
    (cpu_gemm.cpp: pack_panels, gemm_panels); called as panels(x [M, K], bias): fp32 out
    (bf16 x is widened first)."""

    __slots__ = ("gemm", "panels", "out_features")

    def __init__(self, native, weight: torch.Tensor) -> None:
        self.gemm = native.gemm_panels
        self.panels = native.pack_panels(weight.detach())
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.gemm(x, self.panels, self.out_features, bias)


class Tiles:
    """A bf16 weight [N, K] packed as AMX tiles (cpu_amx.cpp: pack_tiles, gemm_tiles); called as
    tiles(x bf16 [M, K], bias): bf16 [M, N], the fp32 sums rounded once. With `silu`, W is a
    gate_up projection [2I, K] (gate rows, then up rows; I a multiple of 16, no bias), packed with
    gate and up interleaved 16 rows by 16, and a call gives silu(gate) * up [M, I] (gemm_tiles_silu:
    the same bits as the GEMM then silu_mul, without the [M, 2I] output between them)."""

    __slots__ = ("gemm", "tiles", "out_features", "silu")

    def __init__(self, native, weight: torch.Tensor, silu: bool = False) -> None:
        weight = weight.detach()
        if silu:
            rows, depth = weight.shape
            if rows % 32:
                raise ValueError(f"a fused gate_up needs gate and up of a multiple of 16 rows, got {rows} in all")
            weight = weight.view(2, rows // 32, 16, depth).transpose(0, 1).reshape(rows, depth)
        self.gemm = native.gemm_tiles_silu if silu else native.gemm_tiles
        self.tiles = native.pack_tiles(weight)
        self.out_features = weight.shape[0]
        self.silu = silu

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.silu:
            return self.gemm(x, self.tiles, self.out_features)
        return self.gemm(x, self.tiles, self.out_features, bias, True)


def onednn_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b on W's oneDNN copy (fp32, at least one row; bf16 x is widened first)."""
    return torch.ops.mkldnn._linear_pointwise(x if x.dtype == torch.float32 else x.float(), packed, bias, "none", [], "")


def onednn_reorder(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of an fp32 CPU weight [out, in] (what onednn_gemm reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)
