"""The scheduler's decode steps as columns (engine/decode_batch.py): a step in which every running
request decodes one token is always a `DecodeStep`, scheduled and postprocessed here.

Such a step comes one of two ways, with the same representation:
  - `_schedule_decode`, first in every step: when nothing is to be admitted, no drafts, forks or
    copy-on-writes, and every new block fits, it decides the step from the columns alone (those
    the last step's postprocess left, or one gather from the requests).
  - `_decode_from_items`: the step the per-request scheduling decided (a preemption, a swap-in, a
    copy-on-write) turns out to be the whole running batch decoding one token each.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.decode_batch import DecodeBatch, DecodeStep, read_columns
from pdserve.engine.request import Request
from pdserve.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.scheduler_config import SchedulerConfig


class DecodeScheduling:
    """Scheduler's part for decode steps (a mixin: the state is the Scheduler's)."""

    config: SchedulerConfig
    block_manager: BlockManager
    eos_token_ids: frozenset[int]
    running: list[Request]
    waiting: list[Request]
    swapped: list[Request]
    parents: dict[str, Request]
    num_tokens_sampled: int
    _decode_batch: DecodeBatch | None

    def _schedule_decode(self, carried: tuple | None) -> DecodeStep | None:
        """The step as columns when it is a steady decode: every running request decoding one
        token, nothing to admit, no drafts, forks or copy-on-writes, room for every new block.
        None: the per-request scheduling decides the step (blocks allocated here before finding
        it is not are what that scheduling allocates first, in the same order). `carried`: the
        columns the last step's postprocess left (positions, token ids, block counts): nothing but
        the scheduler changes a running request, so they hold for every request of that step
        still running (`DecodeBatch.following` keeps those rows); only requests that joined since
        (a decode node's arrivals, at the end of the running list) are read."""
        running, config, bm = self.running, self.config, self.block_manager
        if not running or config.num_lookahead_tokens or self.parents or len(running) > config.max_num_batched_tokens:
            return None
        if self.swapped:  # as _schedule_swapped / _schedule_waiting: nothing is admitted without a seat
            if self._has_seat(self.swapped[0]):
                return None
        elif self.waiting and self._has_seat(self.waiting[0]):
            return None
        batch, carried = self._batch_of_running(carried)
        ids, tables = batch.request_ids, bm.tables
        num_carried = 0 if carried is None else len(carried[0])
        read = read_columns(running[num_carried:], ids[num_carried:], tables) if num_carried < len(running) else None
        if num_carried < len(running) and read is None:
            return None  # a prompt chunk left, or a request without blocks yet
        if carried is None:
            positions, token_ids, num_blocks = read
        else:
            positions, token_ids, num_blocks = carried
            num_blocks = num_blocks.copy()  # the last step's own stays as it was
            if read is not None:  # requests that joined since the last step, at the end
                positions, token_ids, num_blocks = (np.concatenate(pair) for pair in
                                                    zip((positions, token_ids, num_blocks), read))
        for request_id in bm.forked.intersection(ids):  # choices of n > 1 requests (few)
            position = int(positions[ids.index(request_id)])
            if bm.shares_blocks_in(request_id, position, position + 1):
                return None  # a copy-on-write
        grown = np.flatnonzero(positions >= num_blocks * bm.block_size).tolist()  # one request in block_size
        for i in grown:
            target = int(positions[i]) + 1
            if not bm.can_allocate(ids[i], target, write_from=target - 1):
                return None  # a preemption
            num_blocks[i] = len(bm.allocate(ids[i], target))
        return DecodeStep(batch, positions, token_ids, num_blocks, grown, tables, num_carried)

    def _batch_of_running(self, carried: tuple | None) -> tuple[DecodeBatch, tuple | None]:
        """The running list's `DecodeBatch` (kept while the list holds the same requests) and the
        carried columns cut to its rows."""
        batch, running = self._decode_batch, self.running
        if batch is None or batch.requests != running:  # compares identities: a few ns a request
            batch, carried = DecodeBatch.following(batch, running, self.eos_token_ids, carried)
            self._decode_batch = batch
        return batch, carried

    def _decode_from_items(self, out: SchedulerOutput) -> None:
        """Make `out` a `DecodeStep` when its chunks are the whole running batch, in order, each
        decoding one token (no prompt token, no draft slot, no fork to come)."""
        items, running = out.items, self.running
        if len(items) != len(running) or not items:
            return
        for item, request in zip(items, running):
            if (item.request is not request or item.num_new_tokens != 1 or not item.samples
                    or item.num_lookahead_tokens or request.forks
                    or item.num_computed_tokens < len(request.prompt_token_ids)):
                return
        batch, _ = self._batch_of_running(None)
        positions = np.array([s.num_computed_tokens for s in items], dtype=np.int64)
        token_ids = np.array([r.all_token_ids[-1] for r in running], dtype=np.int64)
        num_blocks = np.array([len(s.block_ids) for s in items], dtype=np.int64)
        out.decode = DecodeStep(batch, positions, token_ids, num_blocks, None, self.block_manager.tables, 0)
        out.items = []

    def _postprocess_decode(self, out: SchedulerOutput, sampled) -> list[Request]:
        """`postprocess` of a decode step; `sampled` is (token ids [S] as a list or int64 array,
        logprobs [S] or None) in batch order (ModelRunner's decode sampling), or a mapping of
        request id → (token, logprobs)."""
        decode = out.decode
        batch, requests = decode.batch, decode.requests
        if isinstance(sampled, dict) or self.running != requests:  # a request left while the step ran
            if not isinstance(sampled, dict):
                token_ids = np.asarray(sampled[0], dtype=np.int64).tolist()  # Python ints in the outputs
                sampled = dict(zip(batch.request_ids, zip(token_ids, sampled[1] or repeat(None))))
            out.items = out.scheduled
            out.decode = None
            return self.postprocess(out, sampled)
        token_array = np.asarray(sampled[0], dtype=np.int64)  # the runner's argmax: no copy
        token_ids, logprobs = token_array.tolist(), sampled[1]
        computed = decode.positions + 1
        for request, num_computed, token_id in zip(requests, computed.tolist(), token_ids):
            request.num_computed_tokens = num_computed  # _accept's appends, inlined: every request, every step
            request.output_token_ids.append(token_id)
            request.all_token_ids.append(token_id)
            request.num_new_output_tokens = 1
        if logprobs is not None:
            for request, entry in zip(requests, logprobs):
                if entry is not None:
                    request.output_logprobs.append(entry)
        self.num_tokens_sampled += len(requests)
        bm, ids = self.block_manager, batch.request_ids
        if bm.enable_prefix_caching:  # keys for the blocks that became full
            # Carried rows: the last postprocess keyed every full block, so only those filled now.
            num = decode.num_carried
            lagging = np.flatnonzero(computed[:num] % bm.block_size == 0).tolist()
            if num < len(ids):
                keys = bm.keys
                num_keys = np.array([len(keys.get(i, ())) for i in ids[num:]], dtype=np.int64)
                lagging += (np.flatnonzero(num_keys < computed[num:] // bm.block_size) + num).tolist()
            for i in lagging:
                bm.cache_full_blocks(ids[i], requests[i].all_token_ids, int(computed[i]))
        # Rows that may have ended (a stop id drawn, max_tokens or max_model_len reached) get the
        # exact check; the rest cannot have.
        num_tokens = computed + 1
        flagged = (num_tokens - batch.prompt_lens >= batch.max_tokens) | (num_tokens >= self.config.max_model_len)
        if batch.stop_ids.size:
            flagged |= np.isin(token_array, batch.stop_ids)
        finished = []
        for i in np.flatnonzero(flagged).tolist():
            if self._check_stop(requests[i], token_ids[i]):
                finished.append(requests[i])
        batch.carried = (computed, token_array, decode.num_blocks)  # the next step's, if the batch is unchanged
        out.stepped[:] = requests
        return finished
