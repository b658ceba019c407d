"""Which heads, rows and vocab ids each tensor-parallel rank holds (Megatron), as pure functions.

With N ranks, rank r holds:

    q heads     [r*h, (r+1)*h),  h = num_heads / N                  (num_heads % N == 0)
    KV heads    [r*k, (r+1)*k),  k = num_kv_heads / N               (num_kv_heads >= N, % N == 0)
                one head, r * num_kv_heads // N  (replicated, as vLLM does; N % num_kv_heads == 0)
    MLP rows    [r*i, (r+1)*i),  i = intermediate_size / N          (intermediate_size % N == 0)
    vocab ids   [r*Vp/N, (r+1)*Vp/N) clipped to the vocab, Vp = vocab rounded up to a multiple of N

The q heads of a rank always use KV heads the rank holds: query head j reads KV head
j // (num_heads / num_kv_heads), and the ranges above keep each rank's groups whole.
`kv_head_range` is THE function everyone (model, KV pools, KV hand-off) uses for KV heads.
"""

from __future__ import annotations

from typing import Protocol


class _Shape(Protocol):  # what these functions read of a ModelConfig
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int


def check_tp(model_config: _Shape, size: int) -> None:
    """Raise a one-line ValueError when the model cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    heads, kv_heads, inter = model_config.num_heads, model_config.num_kv_heads, model_config.intermediate_size
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {heads} attention heads")
    if kv_heads >= size and kv_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {kv_heads} KV heads")
    if kv_heads < size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is not a multiple of the model's {kv_heads} KV heads "
                         "(needed to replicate them)")
    if inter % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's intermediate size {inter}")


def _check_rank(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a tensor-parallel group of size {size}")


def q_head_range(rank: int, size: int, num_heads: int) -> tuple[int, int]:
    """[start, end) of the query heads rank `rank` of `size` holds."""
    return shard_range(rank, size, num_heads, "attention heads")


def kv_head_range(rank: int, size: int, num_kv_heads: int) -> tuple[int, int]:
    """[start, end) of the KV heads rank `rank` of `size` holds: its 1/size share, or one replicated
    head when size exceeds num_kv_heads."""
    if num_kv_heads >= size:
        return shard_range(rank, size, num_kv_heads, "KV heads")
    _check_rank(rank, size)
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} is not a multiple of the model's {num_kv_heads} KV heads "
                         "(needed to replicate them)")
    head = rank * num_kv_heads // size
    return head, head + 1


def num_kv_heads_per_rank(model_config: _Shape, size: int) -> int:
    """KV heads each rank holds (every rank holds the same number)."""
    start, end = kv_head_range(0, size, model_config.num_kv_heads)
    return end - start


def shard_range(rank: int, size: int, total: int, what: str = "") -> tuple[int, int]:
    """[start, end) of an evenly divisible dimension (heads, intermediate rows, o_proj input
    columns...); `what` names it in the error ("attention heads": "the model's 9 attention heads")."""
    _check_rank(rank, size)
    if total % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide "
                         + (f"the model's {total} {what}" if what else str(total)))
    per_rank = total // size
    return rank * per_rank, (rank + 1) * per_rank


def padded_vocab_size(size: int, vocab_size: int) -> int:
    """The vocab rounded up to a multiple of `size`: every rank's embedding shard has
    padded_vocab_size / size rows (the last rank's tail rows, past the vocab, are zero padding)."""
    return -(-vocab_size // size) * size


def vocab_range(rank: int, size: int, vocab_size: int) -> tuple[int, int]:
    """[start, end) of the token ids rank `rank` holds, clipped to the vocab (end - start may be
    below the shard's row count on the last rank(s), and even 0)."""
    _check_rank(rank, size)
    per_rank = padded_vocab_size(size, vocab_size) // size
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)
