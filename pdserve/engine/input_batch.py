"""The block tables of the running requests, kept across steps (vLLM v1's persistent batch, for
the one part of a step's batch whose size grows with the sequences: a request of n tokens holds
n / block_size block ids, every step).

Each request owns a row of a preallocated `[rows, max_blocks]` int32 table while it is scheduled.
A step compares each scheduled request's block list (the block manager's, live) with the copy
its row was written from and rewrites only the rows that differ: one new block per request
every block_size decode steps, a copy-on-write, a speculative roll-back, a preemption. The
step's `[S, width]` block tables are then one gather of the scheduled rows.

Rows are released lazily: when a new request finds no free row, rows of requests that this step
does not schedule (finished, preempted or aborted ones) are freed. A row is matched by request
id and checked by content, so a stale row, or an id used again, is rewritten before it is read.

A decode step (engine/decode_batch.py) of the same batch as the step before, when that one was a
decode step too, checks nothing: the scheduler says which tables grew (`DecodeStep.grown`), and
only those rows are rewritten. No other change can reach such a batch's tables: a request leaving
or joining makes a new batch, a decode step that preempted, swapped in or copied on write says
so (`grown` None) and is compared row by row, and roll-backs happen in steps of per-request
chunks, whose gather compares every row and ends the run of trusted steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import ne

import numpy as np
import torch

from pdserve.engine.decode_batch import DecodeBatch, DecodeStep
from pdserve.engine.scheduler_output import ScheduledRequest


class PersistentBlockTables:
    def __init__(self, num_rows: int, num_blocks: int = 16) -> None:
        """`num_rows`: the most requests a step schedules (more grow the table, as do longer tables)."""
        self.table = np.full((max(1, num_rows), max(1, num_blocks)), -1, dtype=np.int32)  # [rows, blocks]
        self.row_of: dict[str, int] = {}  # request id -> its row
        self.written: list[list[int] | None] = [None] * self.table.shape[0]  # the block ids each row holds
        self.free_rows = list(range(self.table.shape[0] - 1, -1, -1))  # popped from the end: row 0 first
        # The decode batch whose rows were last gathered (and those rows), while no other gather
        # has run since: its next step need only rewrite the rows of tables that grew.
        self._trusted: tuple[DecodeBatch, list[int], slice | np.ndarray] | None = None

    def gather(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """[S, max blocks of the step] int32 block tables of `scheduled`, padded with -1."""
        self._trusted = None
        rows = self._rows([s.request.request_id for s in scheduled], [s.block_ids for s in scheduled])
        return self._take(_index(rows), max(len(s.block_ids) for s in scheduled))

    def gather_decode(self, decode: DecodeStep) -> torch.Tensor:
        """The block tables of a decode step."""
        trusted = self._trusted
        if trusted is not None and trusted[0] is decode.batch and decode.grown is not None:
            _, rows, index = trusted
            for i in decode.grown:
                self._write(rows[i], decode.tables[decode.request_ids[i]])
        else:
            rows = self._rows(decode.request_ids, decode.block_lists)
            index = _index(rows)
            self._trusted = (decode.batch, rows, index)
        return self._take(index, int(decode.num_blocks.max()))

    def _take(self, index: slice | np.ndarray, width: int) -> torch.Tensor:
        picked = self.table[index, :width]
        return torch.from_numpy(picked.copy() if isinstance(index, slice) else picked)

    def _rows(self, request_ids: Sequence[str], block_lists: Sequence[list[int]]) -> list[int]:
        """The requests' rows, each checked against its live block list and rewritten if stale."""
        row_of, written = self.row_of, self.written
        rows = [row_of.get(i, -1) for i in request_ids]
        if -1 in rows:  # requests new to the table
            rows = [row if row >= 0 else self._take_row(i, request_ids) for i, row in zip(request_ids, rows)]
        # Rows whose copy differs from the live list (one list compare each, in C).
        for k in compress(range(len(rows)), map(ne, block_lists, [written[r] for r in rows])):
            self._write(rows[k], block_lists[k])
        return rows

    def _write(self, row: int, block_ids: list[int]) -> None:
        num = len(block_ids)
        if num > self.table.shape[1]:  # wider as sequences grow (doubling: rarely)
            wider = np.full((self.table.shape[0], max(num, 2 * self.table.shape[1])), -1, dtype=np.int32)
            wider[:, : self.table.shape[1]] = self.table
            self.table = wider
        old = self.written[row]
        self.table[row, :num] = block_ids
        if old is not None and len(old) > num:
            self.table[row, num : len(old)] = -1
        self.written[row] = list(block_ids)

    def _take_row(self, request_id: str, live_ids: Sequence[str]) -> int:
        if not self.free_rows:
            self._release_unscheduled(live_ids)
        if not self.free_rows:  # more requests than rows: grow
            num = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
            self.written += [None] * num
            self.free_rows = list(range(2 * num - 1, num - 1, -1))
        row = self.row_of[request_id] = self.free_rows.pop()
        return row

    def _release_unscheduled(self, live_ids: Sequence[str]) -> None:
        live = set(live_ids)
        for request_id in [r for r in self.row_of if r not in live]:
            row = self.row_of.pop(request_id)
            self.table[row] = -1
            self.written[row] = None
            self.free_rows.append(row)


def _index(rows: list[int]) -> slice | np.ndarray:
    """Rows in order (the usual case) as a slice, else an index array."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return np.array(rows, dtype=np.intp)
