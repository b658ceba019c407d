"""Which heads, rows and vocab ids each tensor-parallel rank holds (engine/parallel/sharding.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.parallel.sharding import (
    check_tp,
    kv_head_range,
    num_kv_heads_per_rank,
    padded_vocab_size,
    q_head_range,
    shard_range,
    vocab_range,
)
from pdserve.engine.parallel.state import all_gather_last_dim, all_reduce, tp_rank, tp_size


@dataclass
class Shape:
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 64
    vocab_size: int = 261


def test_kv_heads_split_when_there_are_enough():
    assert [kv_head_range(r, 2, 4) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(r, 4, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert num_kv_heads_per_rank(Shape(num_kv_heads=4), 2) == 2


def test_kv_heads_replicated_when_ranks_outnumber_them():
    assert [kv_head_range(r, 4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(r, 2, 1) for r in range(2)] == [(0, 1), (0, 1)]
    assert num_kv_heads_per_rank(Shape(num_kv_heads=1), 2) == 1


def test_q_heads_and_mlp_rows_split_evenly():
    assert [q_head_range(r, 2, 8) for r in range(2)] == [(0, 4), (4, 8)]
    assert [shard_range(r, 4, 64) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 64)]


def test_vocab_not_divisible_pads_the_last_shard():
    assert padded_vocab_size(2, 261) == 262
    assert [vocab_range(r, 2, 261) for r in range(2)] == [(0, 131), (131, 261)]
    assert [vocab_range(r, 4, 5) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # the last holds none
    assert vocab_range(0, 1, 261) == (0, 261)


@pytest.mark.parametrize("shape, size, message", [
    (Shape(num_heads=8), 3, "tensor_parallel_size 3 does not divide the model's 8 attention heads"),
    (Shape(num_heads=12, num_kv_heads=6), 4, "tensor_parallel_size 4 does not divide the model's 6 KV heads"),
    (Shape(num_heads=12, num_kv_heads=2), 3,
     "tensor_parallel_size 3 is not a multiple of the model's 2 KV heads (needed to replicate them)"),
    (Shape(intermediate_size=100), 8, "tensor_parallel_size 8 does not divide the model's intermediate size 100"),
    (Shape(), 0, "tensor_parallel_size must be >= 1, got 0"),
])
def test_check_tp_refuses_with_one_line(shape, size, message):
    with pytest.raises(ValueError) as exc:
        check_tp(shape, size)
    assert str(exc.value) == message and "\n" not in message


def test_check_tp_accepts_splits_and_replication():
    for size in (1, 2, 4, 8):
        check_tp(Shape(), size)  # 8 heads, 4 KV heads (replicated at 8), 64 MLP rows, odd vocab


def test_rank_out_of_range_is_refused():
    with pytest.raises(ValueError, match="rank 2 is not in a tensor-parallel group of size 2"):
        kv_head_range(2, 2, 4)


def test_collectives_are_no_ops_without_a_group():
    import torch

    assert (tp_rank(), tp_size()) == (0, 1)
    x = torch.ones(3)
    assert all_reduce(x) is x and all_gather_last_dim(x) is x


@given(st.integers(0, 4), st.integers(0, 3), st.integers(0, 3), st.integers(1, 1000))
def test_every_rank_holds_the_kv_heads_of_its_query_heads(log_size, log_kv, log_group, vocab):
    size, num_kv_heads = 2**log_size, 2**log_kv
    num_heads = num_kv_heads * 2**log_group
    shape = Shape(num_heads=num_heads, num_kv_heads=num_kv_heads, vocab_size=vocab, intermediate_size=16 * size)
    if num_heads % size:
        with pytest.raises(ValueError):
            check_tp(shape, size)
        return
    check_tp(shape, size)
    group = num_heads // num_kv_heads
    vocab_ids = []
    for rank in range(size):
        q_start, q_end = q_head_range(rank, size, num_heads)
        kv_start, kv_end = kv_head_range(rank, size, num_kv_heads)
        assert kv_end - kv_start == num_kv_heads_per_rank(shape, size)
        # the attention kernel maps the rank's local query head i to local KV head i // (local group):
        # that must be the model's KV head of the query head
        local_q, local_kv = q_end - q_start, kv_end - kv_start
        assert local_q % local_kv == 0
        assert all(q // group == kv_start + (q - q_start) // (local_q // local_kv) for q in range(q_start, q_end))
        start, end = vocab_range(rank, size, vocab)
        assert end - start <= padded_vocab_size(size, vocab) // size
        vocab_ids.extend(range(start, end))
    assert vocab_ids == list(range(vocab))  # disjoint, in rank order, covering the vocab
