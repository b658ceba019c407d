"""One step's flattened batch (`HostBatch`), built on the host from a few flat columns and the
block tables (kept across steps by engine/input_batch.py).

The per-request Python work is kept to gathering those columns (one list comprehension each);
everything derived from them (positions, query starts, padded block tables, slot mappings,
logits rows) is a handful of vectorised torch ops, whatever the batch size. A decode step
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
    num_seqs = len(starts)
    starts_t = _ints(starts)
    if query_lens is None:
        rows = torch.arange(num_seqs)  # token i is request i's
        query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
        positions, seq_lens, max_query_len = starts_t, starts_t + 1, 1
    else:
        lens = _ints(query_lens)
        qsl = torch.zeros(num_seqs + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=qsl[1:])
        rows = torch.repeat_interleave(torch.arange(num_seqs), lens)  # [T] request of each token
        positions = torch.arange(len(token_ids)) - (qsl[:-1] - starts_t)[rows]
        query_start_loc, seq_lens, max_query_len = qsl.to(torch.int32), starts_t + lens, max(query_lens)
    slots = block_tables[rows, positions // block_size].long() * block_size + positions % block_size
    ends = query_start_loc[1:].long()  # one past each request's last token
    return HostBatch(
        input_ids=_ints(token_ids), positions=positions, query_start_loc=query_start_loc,
        seq_lens=seq_lens.to(torch.int32), block_tables=block_tables, slot_mapping=slots.to(torch.int32),
        logits_indices=ends - 1 if num_logits is None else _last_rows(ends, num_logits),
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


def _ints(values: Sequence[int]) -> torch.Tensor:
    """int64 tensor of a list (through numpy: torch.tensor(list) costs ~10x more per element)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def _last_rows(ends: torch.Tensor, num_logits: Sequence[int]) -> torch.Tensor:
    """[L] the last num_logits[s] token rows of each request s, in order."""
    counts = _ints(num_logits)
    owner = torch.repeat_interleave(torch.arange(len(num_logits)), counts)  # [L]
    first = torch.cumsum(counts, 0) - counts  # index in [L] of each request's first row
    return (ends - counts)[owner] + torch.arange(owner.shape[0]) - first[owner]
