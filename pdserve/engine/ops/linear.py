"""Which GEMM a linear layer runs, by device and row count.

On a GPU, and on a CPU for a layer without weight copies, F.linear. On a CPU a layer may hold, next
to its weight (`pack_cpu_linears`, at load time, once weights and dtype are final):

    tiles   a bf16 weight as AMX tiles (CPUs with AMX-BF16): pdserve's AMX GEMM, 1 to TILE_MAX_ROWS
            rows (kernels/cpu_amx.cpp: fp32 sums, one rounding to bf16)
    panels  the weight in 16-column panels: pdserve's few-row GEMM, 1 to PANEL_MAX_ROWS rows
            (kernels/cpu_gemm.cpp: fp32 sums in k order, so a row gets the same bits in any batch)
    packed  oneDNN's reordered copy of an fp32 weight: any other row count. MKL's GEMM (F.linear)
            re-packs W on every call at a few rows, which costs about as much as the GEMM; oneDNN
            reads the copy reordered once (as inductor's freezing path does)

All are fp32 GEMMs with fp32 sums; only the summation order differs. `cpu_linear` is that choice;
`direct_gemm` the same choice made once for a row count, as a plain callable a model calls straight
(models/llama.py: DecoderLayer.forward_direct); `compiled_gemm` such a callable as the compiled
decode step takes it (kernels/cpu_decode_step.cpp: decode_layers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.ops.layer_ops import silu_mul
from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_gemm import Panels, Tiles, onednn_gemm, onednn_reorder

# oneDNN's fixed cost per call (tens of microseconds) pays off from about this many weights; the
# tiny test models stay on F.linear
PACK_MIN_WEIGHTS = 1 << 17
# The panels' GEMM up to this many rows (decode batches); beyond, oneDNN, whose blocking wins on
# prefill-sized inputs.
PANEL_MAX_ROWS = 64
# The AMX tiles up to this many rows; beyond, oneDNN's AMX matmul (F.linear): the rows of x no longer
# fit in L2 beside the weights.
TILE_MAX_ROWS = 512


def cpu_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               packed: torch.Tensor | None, panels: Panels | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """x W^T + b: the tiles', the panels' or oneDNN's GEMM where the layer holds that copy and the
    row count is theirs (see the module docstring), else F.linear. `weight` may be None where
    `packed` is set."""
    if tiles is not None and x.dim() == 2 and 0 < x.shape[0] <= TILE_MAX_ROWS:
        return tiles(x, bias)
    if panels is not None and x.dim() == 2 and 0 < x.shape[0] <= PANEL_MAX_ROWS:
        return panels(x, bias)
    if packed is None or x.numel() == 0:
        return F.linear(x, weight, bias)
    return onednn_gemm(x, packed, bias)


def direct_gemm(packed: torch.Tensor | None, bias: torch.Tensor | None, rows: int,
                tp_combine, panels: Panels | None = None,
                tiles: Tiles | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The GEMM a layer's forward on `rows` rows of x is, exactly, when its output is handed on as
    it is: the tiles', the panels' or `onednn_gemm` on (packed, bias); None with a collective after
    it or none of them."""
    if rows < 1 or tp_combine is not None:
        return None
    if tiles is not None and rows <= TILE_MAX_ROWS:
        return functools.partial(tiles, bias=bias)
    if panels is not None and rows <= PANEL_MAX_ROWS:
        return functools.partial(panels, bias=bias)
    if packed is None:
        return None
    return functools.partial(onednn_gemm, packed=packed, bias=bias)


class SiluAfter:
    """A gate_up GEMM followed by SiLU x up (layer_ops.silu_mul): h -> the down projection's input,
    where the GEMM cannot fuse it (models/llama.py: MLP)."""

    __slots__ = ("gemm",)

    def __init__(self, gemm: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.gemm = gemm

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return silu_mul(self.gemm(h))


def compiled_gemm(gemm: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, torch.Tensor, int, torch.Tensor] | None:
    """A direct GEMM (`direct_gemm`) as the compiled decode step takes it: (kind: 0 tiles, 1 panels,
    2 tiles with SiLU x up fused (Tiles(silu=True)); the packed weight; the output width; the bias,
    empty for none), or None for oneDNN's, which only Python calls. A SiluAfter is its GEMM's (the
    step runs silu_mul after kinds 0 and 1)."""
    if isinstance(gemm, SiluAfter):
        gemm = gemm.gemm
    if isinstance(gemm, Tiles) and gemm.silu:
        return 2, gemm.tiles, gemm.out_features, torch.empty(0, dtype=gemm.tiles.dtype)
    func = getattr(gemm, "func", None)
    if not isinstance(func, (Tiles, Panels)):
        return None
    bias = gemm.keywords.get("bias")
    packed = func.tiles if isinstance(func, Tiles) else func.panels
    return (0 if isinstance(func, Tiles) else 1, packed, func.out_features,
            torch.empty(0, dtype=packed.dtype) if bias is None else bias)


class PackedLinear(nn.Linear):
    """nn.Linear that runs `cpu_linear` on the CPU weight copies it is given (none: F.linear), then
    its collective `tp_combine` (None: none; engine/parallel/layers.py sets it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp_combine = None
        self.packed: torch.Tensor | None = None  # oneDNN's copy of the weight
        self.panels: Panels | None = None  # the weight in panels for a few rows
        self.tiles: Tiles | None = None  # a bf16 weight as AMX tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_linear(x, self.weight, self.bias, self.packed, self.panels, self.tiles)
        return y if self.tp_combine is None else self.tp_combine(y)

    def direct_gemm(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return direct_gemm(self.packed, self.bias, rows, self.tp_combine, self.panels, self.tiles)


def amx_tiles(weight: torch.Tensor) -> Tiles | None:
    """AMX tiles of a bf16 CPU weight where the compiled ops load and the CPU runs AMX-BF16, else None."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    native = cpu_native.load()
    return Tiles(native, weight) if native is not None and native.amx_available() else None


def onednn_packed_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of an fp32 CPU weight [out, in] of at least PACK_MIN_WEIGHTS weights
    (see cpu_linear), else None."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32
            or weight.numel() < PACK_MIN_WEIGHTS or not torch.backends.mkldnn.is_available()):
        return None
    return onednn_reorder(weight)


def pack_cpu_linears(model: nn.Module) -> int:
    """Give every big enough fp32 CPU PackedLinear of `model` its oneDNN copy and, where the compiled
    ops load (kernels/cpu_native.py), its weight in panels for decode rows, and every bf16 CPU layer
    its AMX tiles where the CPU has AMX; returns how many got a copy. The layer keeps its weight (the
    model's parameter): an fp32 layer with both copies holds its weights three times, a bf16 layer
    with tiles twice."""
    num = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.tiles = amx_tiles(module.weight)
            module.packed = onednn_packed_weight(module.weight)
            native = cpu_native.load() if module.packed is not None else None
            module.panels = None if native is None else Panels(native, module.weight)
            num += module.packed is not None or module.tiles is not None
    return num
