"""One step's flattened batch (`HostBatch`), built on the host from a few flat columns and the
block tables (kept across steps by engine/input_batch.py).

The per-request Python work is kept to gathering those columns (one list comprehension each);
everything derived from them (positions, query starts, padded block tables, slot mappings,
logits rows) is a handful of vectorised numpy ops, whatever the batch size. A decode step
(one token per request: `query_lens=None`) skips the ops a ragged batch needs.

    tokens:     | r0: q0 tokens | r1: q1 tokens | ... |        T = sum of query lens
    positions:    starts[s] .. starts[s] + q_s - 1              (request s's new tokens)
    logits:       the last num_logits[s] tokens of request s     (0: a chunk that does not sample)
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from pdserve.engine.parallel.step_wire import HostBatch


def build_host_batch(
    token_ids: list[int],  # [T] fed this step, request by request
    starts: list[int],  # [S] position of each request's first new token
    block_tables: torch.Tensor,  # [S, max blocks] int32, -1 padded (pad_tables, or kept across steps)
    block_size: int,
    query_lens: list[int] | None = None,  # [S] tokens fed per request; None: one each (a decode step)
    num_logits: Sequence[int] | None = None,  # [S] logits wanted per request (its last tokens); None: 1 each
) -> HostBatch:
    # numpy, not torch, for these small arrays: a torch op costs ~10 us of dispatch on the CPU,
    # a numpy one ~1 us (a decode step's batch took 150 us in torch at 256 requests).
    num_seqs = len(starts)
    starts_a = np.array(starts, dtype=np.int64)
    if query_lens is None:
        rows = np.arange(num_seqs)  # token i is request i's
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
        positions, seq_lens, max_query_len = starts_a, starts_a + 1, 1
    else:
        lens = np.array(query_lens, dtype=np.int64)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        rows = np.repeat(np.arange(num_seqs), lens)  # [T] request of each token
        positions = np.arange(len(token_ids)) - (qsl[:-1] - starts_a)[rows]
        query_start_loc, seq_lens, max_query_len = qsl.astype(np.int32), starts_a + lens, max(query_lens)
    slots = block_tables.numpy()[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    ends = query_start_loc[1:].astype(np.int64)  # one past each request's last token
    return HostBatch(
        input_ids=torch.from_numpy(np.array(token_ids, dtype=np.int64)), positions=torch.from_numpy(positions),
        query_start_loc=torch.from_numpy(query_start_loc), seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        block_tables=block_tables, slot_mapping=torch.from_numpy(slots.astype(np.int32)),
        logits_indices=torch.from_numpy(ends - 1 if num_logits is None else _last_rows(ends, num_logits)),
        max_query_len=max_query_len, max_seq_len=int(seq_lens.max()),
    )


def pad_tables(tables: Sequence[list[int]]) -> torch.Tensor:
    """[S, max blocks] int32 of the block tables, padded with -1: one conversion of the flat ids."""
    lens = [len(t) for t in tables]
    width = max(lens)
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=sum(lens))
    if min(lens) == width:
        return torch.from_numpy(flat.reshape(len(tables), width))
    padded = np.full((len(tables), width), -1, dtype=np.int32)
    padded[np.arange(width) < np.array(lens)[:, None]] = flat  # row-major, as flattened
    return torch.from_numpy(padded)


def _last_rows(ends: np.ndarray, num_logits: Sequence[int]) -> np.ndarray:
    """[L] the last num_logits[s] token rows of each request s, in order."""
    counts = np.array(num_logits, dtype=np.int64)
    owner = np.repeat(np.arange(len(num_logits)), counts)  # [L]
    first = np.cumsum(counts) - counts  # index in [L] of each request's first row
    return (ends - counts)[owner] + np.arange(owner.shape[0]) - first[owner]
