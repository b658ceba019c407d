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
that a layer swap keeping it (engine/models/cpu_bf16.py) keeps the layer's semantics. Which GEMM a
linear layer runs on its shard (F.linear, or a CPU weight copy) is engine/ops/linear.py's choice.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.ops.linear import PackedLinear
from pdserve.engine.parallel.sharding import padded_vocab_size, vocab_range
from pdserve.engine.parallel.state import all_gather_last_dim, all_reduce


class ColumnParallelLinear(PackedLinear):
    def __init__(self, in_features: int, parts: list[tuple[int, int, int]], bias: bool) -> None:
        """`parts`: per fused checkpoint tensor, (start, end, full_rows): this rank holds its rows [start, end)."""
        self.parts = list(parts)
        self.offsets = [0]
        for start, end, _ in self.parts:
            self.offsets.append(self.offsets[-1] + end - start)
        super().__init__(in_features, self.offsets[-1], bias=bias)  # tp_combine None: the rank's rows as they are

    def load_shard(self, param_name: str, full: torch.Tensor, part: int = 0) -> None:
        start, end, full_rows = self.parts[part]
        param = getattr(self, param_name)
        dest = param[self.offsets[part] : self.offsets[part + 1]]
        _check_shape(full, (full_rows, *dest.shape[1:]))
        dest.copy_(full[start:end])


class RowParallelLinear(PackedLinear):
    def __init__(self, in_range: tuple[int, int, int], out_features: int, size: int) -> None:
        """`in_range`: (start, end, full_in_features): this rank's input columns. No bias (o_proj, down_proj)."""
        self.in_range = in_range
        super().__init__(in_range[1] - in_range[0], out_features, bias=False)
        self.tp_combine = all_reduce if size > 1 else None

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


class ParallelLMHead(PackedLinear):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, size: int) -> None:
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = vocab_range(rank, size, vocab_size)
        super().__init__(hidden_size, padded_vocab_size(size, vocab_size) // size, bias=False)
        # [S, hidden] -> [S, vocab]: the ranks' logits gathered, cut to the vocab
        self.tp_combine = functools.partial(_gather_vocab, vocab_size=vocab_size) if size > 1 else None

    def load_shard(self, param_name: str, full: torch.Tensor, part: int = 0) -> None:
        _load_vocab_rows(self.weight, full, self.vocab_start, self.vocab_end, self.vocab_size)


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
