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
    token_ids: Sequence[int],  # [T] fed this step, request by request (a list or an int64 array)
    starts: Sequence[int],  # [S] position of each request's first new token (a list or an int64 array)
    block_tables: torch.Tensor,  # [S, max blocks] int32, -1 padded (pad_tables, or kept across steps)
    block_size: int,
    query_lens: list[int] | None = None,  # [S] tokens fed per request; None: one each (a decode step)
    num_logits: Sequence[int] | None = None,  # [S] logits wanted per request (its last tokens); None: 1 each
) -> HostBatch:
    # numpy, not torch, for these small arrays: a torch op's dispatch costs several numpy ops on the CPU.
    num_seqs = len(starts)
    tables = block_tables.numpy()
    if query_lens is None:  # a decode step: token i is request i's, at position starts[i]
        positions = np.array(starts, dtype=np.int64)
        rows = np.arange(num_seqs)
        query_start_loc = np.arange(num_seqs + 1, dtype=np.int32)
        seq_lens = positions.astype(np.int32)
        seq_lens += 1
        logits_indices = rows if num_logits is None else _last_rows(rows + 1, num_logits)
        max_query_len, max_seq_len = 1, int(positions.max()) + 1
    else:
        starts_a, lens = np.array(starts, dtype=np.int64), np.array(query_lens, dtype=np.int64)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(lens, out=qsl[1:])
        rows = np.repeat(np.arange(num_seqs), lens)  # [T] request of each token
        positions = np.arange(len(token_ids)) - (qsl[:-1] - starts_a)[rows]
        query_start_loc, seq_lens = qsl.astype(np.int32), (starts_a + lens).astype(np.int32)
        ends = qsl[1:]  # one past each request's last token
        logits_indices = ends - 1 if num_logits is None else _last_rows(ends, num_logits)
        max_query_len, max_seq_len = max(query_lens), int(seq_lens.max())
    slots = tables[rows, positions // block_size]  # int32 block ids, then slots (int32, as on the wire)
    slots *= block_size
    slots += positions % block_size
    return HostBatch(
        input_ids=torch.from_numpy(np.array(token_ids, dtype=np.int64)), positions=torch.from_numpy(positions),
        query_start_loc=torch.from_numpy(query_start_loc), seq_lens=torch.from_numpy(seq_lens),
        block_tables=block_tables, slot_mapping=torch.from_numpy(slots), logits_indices=torch.from_numpy(logits_indices),
        max_query_len=max_query_len, max_seq_len=max_seq_len,
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
