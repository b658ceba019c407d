"""A decode step as columns: the one representation of a step in which every running request
decodes one token (the steady state of decoding).

Most steps of a decode node, and of any engine between admissions, are the same requests decoding
one token each. Such a step is a `DecodeStep`: numpy columns, with the per-request constants (ids,
prompt lengths, max_tokens, stop ids) kept in a `DecodeBatch` for as long as the running list holds
the same requests in the same order, so the host's work per step stays a few array operations.

    schedule:     positions = computed tokens, one new slot each; blocks only where a request
                  crosses into a new block. The columns come from the last step's postprocess
                  when it was this batch's (`DecodeBatch.carried`): no request is read at all;
                  else one attribute gather per column (engine/scheduler_decode.py).
    runner:       host batch from the columns; block-table rows rewritten only where a table
                  grew (input_batch.py); all-greedy batches: one argmax, a list of ids back
    postprocess:  one loop appending tokens; stop and length checks as array compares, the exact
                  per-request check only for the rows they flag; the next step's columns left

A step with anything else in it (a prompt chunk, drafts, a request not scheduled for lack of
budget) is a list of per-request chunks (`ScheduledRequest`, engine/scheduler_output.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat

import numpy as np

from pdserve.engine.request import Request


class DecodeBatch:
    """The running requests' per-request constants, as columns (valid while `requests` is the
    running list: same objects, same order; the scheduler compares the lists every step)."""

    def __init__(self, requests: list[Request], eos_token_ids: frozenset[int]) -> None:
        self.requests = list(requests)
        self.request_ids = [r.request_id for r in requests]
        params = [r.params for r in requests]
        self.prompt_lens = np.array([len(r.prompt_token_ids) for r in requests], dtype=np.int64)
        self.max_tokens = np.array([p.max_tokens for p in params], dtype=np.int64)
        # Every token id that may end one of them; a row sampling one gets the exact check.
        stop = set().union(*(p.stop_token_ids for p in params))
        if not all(p.ignore_eos for p in params):
            stop |= eos_token_ids
        self.stop_ids = np.array(sorted(stop), dtype=np.int64)
        self.all_plain_greedy = all(r.is_plain_greedy for r in requests)
        # (positions, token ids, block counts) for the next step, left by the postprocess of a
        # decode step of this batch and taken by the next schedule (scheduler_decode.py says why
        # they can be trusted).
        self.carried: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def following(cls, old: DecodeBatch | None, requests: list[Request], eos_token_ids: frozenset[int],
                  carried: tuple | None) -> tuple[DecodeBatch, tuple | None]:
        """The batch of `requests`, and `carried` (the last step's columns, for `old`'s rows) cut
        to the rows still there. Where `requests` is `old`'s in its order less some (finished,
        aborted), then new ones (a decode node's arrivals), `old`'s constants and columns are
        kept for the first part and only the new requests are read; otherwise built afresh (and
        nothing carried)."""
        if old is None:
            return cls(requests, eos_token_ids), None
        where = dict(zip(old.requests, range(len(old.requests))))  # Request compares by identity
        found = np.fromiter(map(where.get, requests, repeat(-1)), dtype=np.intp, count=len(requests))
        missing = np.flatnonzero(found < 0)
        num = int(missing[0]) if missing.size else len(requests)  # the leading requests that were old's
        keep = found[:num]
        if not num or len(missing) != len(requests) - num or (num > 1 and (np.diff(keep) <= 0).any()):
            return cls(requests, eos_token_ids), None
        joined = requests[num:]
        new = cls(joined, eos_token_ids) if joined else None
        batch = cls.__new__(cls)
        batch.requests = list(requests)
        batch.request_ids = list(map(old.request_ids.__getitem__, keep.tolist()))
        batch.prompt_lens, batch.max_tokens = old.prompt_lens[keep], old.max_tokens[keep]
        # A superset of the stop ids is sound (flagged rows get the exact check): the old ones stay.
        batch.stop_ids = old.stop_ids
        batch.all_plain_greedy = old.all_plain_greedy or all(r.is_plain_greedy for r in requests)
        if new is not None:
            batch.request_ids += new.request_ids
            batch.prompt_lens = np.concatenate([batch.prompt_lens, new.prompt_lens])
            batch.max_tokens = np.concatenate([batch.max_tokens, new.max_tokens])
            if new.stop_ids.size:
                batch.stop_ids = np.union1d(old.stop_ids, new.stop_ids)
            batch.all_plain_greedy = batch.all_plain_greedy and new.all_plain_greedy
        batch.carried = None
        if carried is not None:
            carried = tuple(column[keep] for column in carried)
        return batch, carried


@dataclass(slots=True)
class DecodeStep:
    """One step: every request of `batch` feeds its last token at position = its computed tokens."""

    batch: DecodeBatch
    positions: np.ndarray  # [S] int64: each request's computed tokens, where its new token goes
    token_ids: np.ndarray  # [S] int64: the tokens fed, each request's last
    num_blocks: np.ndarray  # [S] int64: the blocks each request holds for this step
    # Indices of the requests given a block this step: the only tables that changed since the last
    # step, when that step was one of the same batch. None: any table may have changed (a step that
    # preempted, swapped in or copied on write).
    grown: list[int] | None
    tables: dict[str, list[int]]  # the block manager's tables (request id -> block ids), live
    num_carried: int  # the first rows' columns came from the last step's (engine/scheduler_decode.py)

    @property
    def requests(self) -> list[Request]:
        return self.batch.requests

    @property
    def request_ids(self) -> list[str]:
        return self.batch.request_ids

    @property
    def block_lists(self) -> list[list[int]]:
        """[S] each request's block table (the block manager's live lists, looked up when asked:
        empty for a request that has left since the step was scheduled)."""
        tables = self.tables
        return [tables.get(i, []) for i in self.batch.request_ids]

    def __len__(self) -> int:
        return len(self.token_ids)


def read_columns(requests: list[Request], ids: list[str], tables: dict[str, list[int]]):
    """(positions, fed tokens, block counts) of requests each decoding one token, read from them;
    None when one is not (a prompt chunk left) or holds no blocks yet."""
    positions = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
    lengths = np.array([len(r.all_token_ids) for r in requests], dtype=np.int64)
    lengths -= positions
    if (lengths != 1).any():
        return None
    try:
        num_blocks = np.array([len(tables[i]) for i in ids], dtype=np.int64)
    except KeyError:
        return None
    return positions, np.array([r.all_token_ids[-1] for r in requests], dtype=np.int64), num_blocks
