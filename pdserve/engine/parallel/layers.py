"""Megatron's tensor-parallel layers: each rank holds a slice of the weight and loads it from the
full checkpoint tensor (`load_shard`).

    ColumnParallelLinear   y_r = x W_r^T: the rank's output rows (its heads / MLP rows); no collective.
                           Fused projections (q/k/v, gate/up) stay one matmul: the rank's rows of
                           every part are stacked in part order.
    RowParallelLinear      y = sum_r x_r W_r^T: the rank's input columns, then an all-reduce.
    VocabParallelEmbedding the rank's vocab rows; ids outside them give zeros; an all-reduce.
    ParallelLMHead         the rank's vocab rows; the ranks' logits all-gathered, cut to the vocab.

At size 1 every layer is the plain nn.Linear / nn.Embedding (same parameters, same forward, no
collective). The collective runs in `tp_combine`, a plain function attribute (None at size 1) so
that a layer swap keeping it (engine/models/cpu_bf16.py) keeps the layer's semantics.

On a CPU every fp32 layer of at least PACK_MIN_WEIGHTS weights also holds its weight reordered for
oneDNN and in panels, and on a CPU with AMX every bf16 layer its weight as AMX tiles
(`pack_cpu_linears`, at load time); `cpu_linear` says when each is used and why.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.parallel.sharding import padded_vocab_size, vocab_range
from pdserve.engine.parallel.state import all_gather_last_dim, all_reduce
from pdserve.kernels import cpu_native


class ColumnParallelLinear(nn.Linear):
    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool) -> None:
        """`parts`: per fused checkpoint tensor, (start, end, full_rows): this rank holds its rows [start, end)."""
        self.parts = list(parts)
        self.offsets = [0]
        for start, end, _ in self.parts:
            self.offsets.append(self.offsets[-1] + end - start)
        super().__init__(in_features, self.offsets[-1], bias=bias)
        self.tp_combine = None  # the next layer takes the rank's rows as they are
        self.packed = None  # oneDNN's copy of the weight (pack_cpu_linears)
        self.panels: Panels | None = None  # the weight in panels for a few rows (pack_cpu_linears)
        self.tiles: Tiles | None = None  # a bf16 weight as AMX tiles (pack_cpu_linears)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_linear(x, self.weight, self.bias, self.packed, self.panels, self.tiles)

    def direct_gemm(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return direct_gemm(self.packed, self.bias, rows, None, self.panels, self.tiles)

    def load_shard(self, param_name: str, full: torch.Tensor, part: int = 0) -> None:
        start, end, full_rows = self.parts[part]
        param = getattr(self, param_name)
        dest = param[self.offsets[part] : self.offsets[part + 1]]
        _check_shape(full, (full_rows, *dest.shape[1:]))
        dest.copy_(full[start:end])


class RowParallelLinear(nn.Linear):
    def __init__(self, in_range: tuple[int, int, int], out_features: int, size: int) -> None:
        """`in_range`: (start, end, full_in_features): this rank's input columns. No bias (o_proj, down_proj)."""
        self.in_range = in_range
        super().__init__(in_range[1] - in_range[0], out_features, bias=False)
        self.tp_combine = all_reduce if size > 1 else None
        self.packed = None
        self.panels: Panels | None = None
        self.tiles: Tiles | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cpu_linear(x, self.weight, self.bias, self.packed, self.panels, self.tiles)
        return y if self.tp_combine is None else self.tp_combine(y)

    def direct_gemm(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return direct_gemm(self.packed, self.bias, rows, self.tp_combine, self.panels, self.tiles)

    def load_shard(self, param_name: str, full: torch.Tensor, part: int = 0) -> None:
        start, end, full_in = self.in_range
        _check_shape(full, (self.out_features, full_in))
        self.weight.copy_(full[:, start:end])


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, size: int) -> None:
        self.vocab_size, self.size = vocab_size, size
        self.vocab_start, self.vocab_end = vocab_range(rank, size, vocab_size)
        super().__init__(padded_vocab_size(size, vocab_size) // size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mine, input_ids - self.vocab_start, 0)
        x = F.embedding(local_ids, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        return all_reduce(x)

    def load_shard(self, param_name: str, full: torch.Tensor, part: int = 0) -> None:
        _load_vocab_rows(self.weight, full, self.vocab_start, self.vocab_end, self.vocab_size)


class ParallelLMHead(nn.Linear):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, size: int) -> None:
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = vocab_range(rank, size, vocab_size)
        super().__init__(hidden_size, padded_vocab_size(size, vocab_size) // size, bias=False)
        self.tp_combine = functools.partial(_gather_vocab, vocab_size=vocab_size) if size > 1 else None
        self.packed = None
        self.panels: Panels | None = None
        self.tiles: Tiles | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, hidden] -> [S, vocab]
        y = cpu_linear(hidden, self.weight, self.bias, self.packed, self.panels, self.tiles)
        return y if self.tp_combine is None else self.tp_combine(y)

    def load_shard(self, param_name: str, full: torch.Tensor, part: int = 0) -> None:
        _load_vocab_rows(self.weight, full, self.vocab_start, self.vocab_end, self.vocab_size)


# ---- CPU GEMMs ------------------------------------------------------------------------------
PACK_BATCH_HINT = 16  # the rows oneDNN tunes the reordered layout for; any number of rows runs on it
# oneDNN's fixed cost per call (~25-30 us on 2 threads) pays off from about 128K weights: on an AVX2
# EPYC, 30 distinct weights called in turn (as a step does), 256 x 256 tied with F.linear at 1 and
# 16 rows, 384 x 384 took 0.84-0.89x, 64 x 192 took 1.6-4.3x; the tiny test models stay on F.linear
PACK_MIN_WEIGHTS = 1 << 17
# Up to this many rows a layer with its weight in panels runs the compiled few-row GEMM on them
# (Panels; models/cpu_bf16.py too). On the default model's shapes (AVX2 EPYC, 2 threads) it took
# 0.52-0.60x oneDNN's time at 16 rows and 0.74-0.96x at 64; beyond, the comparison flipped with the
# machine's phase (0.82-0.92x in one run, 1.10-1.28x in another at 128-512 rows: benchmarks/RESULTS.md)
PANEL_MAX_ROWS = 64
# Up to this many rows a bf16 layer with AMX tiles runs pdserve's AMX GEMM (Tiles); beyond, F.linear
# (oneDNN's AMX matmul). On the default model's shapes (2 cores with AMX, 121 GEMMs in turn) the tiles
# took 10.4-11 ms from 1 to 16 rows (the weights' streaming time) against oneDNN's 14-15 ms on a
# reordered copy and F.linear's 20-22; 0.78x F.linear at 64 rows, level at 512, 1.05x at 1024 and 1.7x
# at 2048 (the rows of x no longer fit L2 beside the weights: benchmarks/RESULTS.md, eighth part)
TILE_MAX_ROWS = 512


def cpu_linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               packed: torch.Tensor | None, panels: Panels | None = None, tiles: Tiles | None = None) -> torch.Tensor:
    """x W^T + b. From 1 to TILE_MAX_ROWS rows of bf16 x, with the bf16 weight as AMX tiles
    (`tiles`), pdserve's AMX GEMM computes it (kernels/cpu_amx.cpp: fp32 sums, one rounding to bf16).
    From 1 to PANEL_MAX_ROWS rows of x, with the weight in panels (`panels`),
    pdserve's few-row GEMM computes it (kernels/cpu_decode.cpp: gemm_panels; on an AVX2 EPYC, 2
    threads, the default model's fp32 decode GEMMs took 0.5-0.6x oneDNN's time at one row and at
    16, fp32 sums in k order). Otherwise, with a oneDNN copy of W (`packed`), oneDNN computes it: MKL's GEMM
    (F.linear) re-packs W on every call at a few rows, which costs about as much as the GEMM, and
    oneDNN reads the copy reordered once (inductor's freezing path does the same). Measured on the
    same EPYC, the default model's shapes, 30 weights in turn: 0.51-0.83x of F.linear's time at 2-16
    rows; at 512 rows 0.62x on gate_up, 0.92x on qkv, tied on o and down; at one row 0.64-0.92x
    except down_proj (1.14-1.49x; a layer's four GEMVs together 0.78-0.88x). All are fp32 GEMMs
    with fp32 sums; only the summation order differs. `weight` may be None where `packed` is set."""
    if tiles is not None and x.dim() == 2 and 0 < x.shape[0] <= TILE_MAX_ROWS:
        return tiles(x, bias)
    if panels is not None and x.dim() == 2 and 0 < x.shape[0] <= PANEL_MAX_ROWS:
        return panels(x, bias)
    if packed is None or x.numel() == 0:
        return F.linear(x, weight, bias)
    return onednn_gemm(x, packed, bias)


def onednn_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b on W's oneDNN copy (fp32, at least one row; bf16 x is widened first)."""
    return torch.ops.mkldnn._linear_pointwise(x if x.dtype == torch.float32 else x.float(), packed, bias, "none", [], "")


def direct_gemm(packed: torch.Tensor | None, bias: torch.Tensor | None, rows: int,
                tp_combine, panels: Panels | None = None,
                tiles: Tiles | None = None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The GEMM a layer's forward on `rows` rows of x is, exactly, when its output is handed on as
    it is: the AMX tiles' (bf16, 1 to TILE_MAX_ROWS rows), the panels' (1 to PANEL_MAX_ROWS rows) or
    `onednn_gemm` on (packed, bias) (a oneDNN copy, at least one row); None with a collective after
    it or none of them. A model calls such layers' GEMMs straight (models/llama.py:
    DecoderLayer.forward_direct)."""
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
    """A gate_up GEMM followed by the compiled SiLU x up (kernels/cpu_decode.cpp: silu_mul): h ->
    the down projection's input, where the GEMM cannot fuse it (models/llama.py: MLP)."""

    __slots__ = ("gemm", "silu_mul")

    def __init__(self, gemm: Callable[[torch.Tensor], torch.Tensor], native) -> None:
        self.gemm, self.silu_mul = gemm, native.silu_mul

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.silu_mul(self.gemm(h))


def compiled_gemm(gemm: Callable[[torch.Tensor], torch.Tensor]) -> tuple[int, torch.Tensor, int, torch.Tensor] | None:
    """A direct GEMM (`direct_gemm`) as the compiled layer loop takes it (kernels/cpu_decode.cpp:
    decode_layers): (kind: 0 tiles, 1 panels, 2 tiles with SiLU x up fused (Tiles(silu=True)); the
    packed weight; the output width; the bias, empty for none), or None for oneDNN's, which only
    Python calls. A SiluAfter is its GEMM's (the loop runs silu_mul after kinds 0 and 1)."""
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


class Panels:
    """A weight [N, K] (bf16 or fp32) packed in 16-column panels for the compiled few-row GEMM
    (kernels/cpu_decode.cpp: pack_panels, gemm_panels); called as panels(x [M, K], bias): fp32 out
    (bf16 x is widened first)."""

    __slots__ = ("gemm", "panels", "out_features")

    def __init__(self, native, weight: torch.Tensor) -> None:
        self.gemm = native.gemm_panels
        self.panels = native.pack_panels(weight.detach())
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.gemm(x, self.panels, self.out_features, bias)


class Tiles:
    """A bf16 weight [N, K] packed as AMX tiles (kernels/cpu_amx.cpp: pack_tiles, gemm_tiles); called
    as tiles(x bf16 [M, K], bias): bf16 [M, N], the fp32 sums rounded once. With `silu`, W is a
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
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def pack_cpu_linears(model: nn.Module) -> int:
    """Give every big enough fp32 CPU layer of `model` its oneDNN copy and, where the compiled ops
    load (kernels/cpu_native.py), its weight in panels for decode rows, and every bf16 CPU layer
    its AMX tiles where the CPU has AMX (load time, after the weights and the dtype are final);
    returns how many got a copy. The layer keeps its weight (the model's parameter): an fp32 layer
    with both copies holds its weights three times, a bf16 layer with tiles twice."""
    num = 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            module.tiles = amx_tiles(module.weight)
            module.packed = onednn_packed_weight(module.weight)
            native = cpu_native.load() if module.packed is not None else None
            module.panels = None if native is None else Panels(native, module.weight)
            num += module.packed is not None or module.tiles is not None
    return num


def _gather_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Every rank's [S, Vp/N] logits, in rank order, cut to the vocab (the padding columns dropped)."""
    return all_gather_last_dim(logits)[..., :vocab_size]


def _load_vocab_rows(weight: torch.Tensor, full: torch.Tensor, start: int, end: int, vocab_size: int) -> None:
    _check_shape(full, (vocab_size, weight.shape[1]))
    weight[: end - start].copy_(full[start:end])
    weight[end - start :].zero_()  # padding rows past the vocab: never looked up, their logits cut off


def _check_shape(full: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(full.shape) != tuple(expected):
        raise ValueError(f"checkpoint shape {tuple(full.shape)}, model expects {tuple(expected)}")
