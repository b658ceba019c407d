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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pdserve.engine.scheduler_output import ScheduledRequest


class PersistentBlockTables:
    def __init__(self, num_rows: int, num_blocks: int = 16) -> None:
        """`num_rows`: the most requests a step schedules (more grow the table, as do longer tables)."""
        self.table = np.full((max(1, num_rows), max(1, num_blocks)), -1, dtype=np.int32)  # [rows, blocks]
        self.row_of: dict[str, int] = {}  # request id -> its row
        self.written: list[list[int] | None] = [None] * self.table.shape[0]  # the block ids each row holds
        self.free_rows = list(range(self.table.shape[0] - 1, -1, -1))  # popped from the end: row 0 first

    def gather(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        """[S, max blocks of the step] int32 block tables of `scheduled`, padded with -1."""
        rows = []
        row_of, written = self.row_of, self.written
        for s in scheduled:  # per request of the batch: kept lean
            row = row_of.get(s.request.request_id)
            if row is None:
                row = self._take_row(s.request.request_id, scheduled)
            if s.block_ids != written[row]:
                self._write(row, s.block_ids)
            rows.append(row)
        width = max(len(s.block_ids) for s in scheduled)
        if rows == list(range(rows[0], rows[0] + len(rows))):  # in row order: a slice, copied
            return torch.from_numpy(self.table[rows[0] : rows[0] + len(rows), :width].copy())
        return torch.from_numpy(self.table[np.array(rows, dtype=np.intp), :width])

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

    def _take_row(self, request_id: str, scheduled: Sequence[ScheduledRequest]) -> int:
        if not self.free_rows:
            self._release_unscheduled(scheduled)
        if not self.free_rows:  # more requests than rows: grow
            num = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
            self.written += [None] * num
            self.free_rows = list(range(2 * num - 1, num - 1, -1))
        row = self.row_of[request_id] = self.free_rows.pop()
        return row

    def _release_unscheduled(self, scheduled: Sequence[ScheduledRequest]) -> None:
        live = {s.request.request_id for s in scheduled}
        for request_id in [r for r in self.row_of if r not in live]:
            row = self.row_of.pop(request_id)
            self.table[row] = -1
            self.written[row] = None
            self.free_rows.append(row)
