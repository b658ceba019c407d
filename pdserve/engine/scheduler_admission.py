"""Admission and preemption: how requests enter and leave the running batch (a mixin of
`Scheduler`, engine/scheduler.py).

Swapped requests come back in first, then waiting requests are admitted, each queue in the
scheduling policy's order (engine/scheduling_policy.py: fcfs, priority, or shortest job first with
aging, which re-sorts a queue before admitting from it), while `max_num_seqs`, the token budget and
free blocks (less the watermark) allow. A prompt longer than the budget is split over steps
(chunked prefill). A preempted request is swapped to host blocks when swap space allows, else its
blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager
    from pdserve.engine.scheduler_config import SchedulerConfig
    from pdserve.engine.scheduling_policy import SchedulingPolicy


def queue_order(request: Request) -> tuple[int, int]:
    """The order of the waiting and swapped queues, and of preemption (the largest goes first)."""
    return (request.priority, request.arrival_seq)


class Admission:
    """Scheduler's part for the waiting and swapped queues (a mixin: the state is the Scheduler's)."""

    config: SchedulerConfig
    block_manager: BlockManager
    policy: SchedulingPolicy
    clock: Callable[[], float]
    waiting: list[Request]
    running: list[Request]
    swapped: list[Request]
    receiving_kv: dict[str, Request]
    parents: dict[str, Request]
    num_preemptions: int

    def _sort_for_admission(self, queue: list[Request], *, receiving: bool = False) -> None:
        """sjf's order changes as requests wait: a queue is sorted just before requests are
        admitted from it, and not when the batch is full (its queue is then the longest)."""
        if self.policy.is_time_dependent and self._num_seqs(receiving=receiving) < self.config.max_num_seqs:
            self.policy.sort(queue, self.clock())

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        if budget > 0:
            self._sort_for_admission(self.swapped)
        while self.swapped and budget > 0 and self._has_seat(self.swapped[0]):
            request = self.swapped[0]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            target = request.num_computed_tokens + num_new
            if not bm.can_swap_in(request.request_id, target):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(bm.swap_in(request.request_id, target))
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, num_new)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        if budget > 0:
            self._sort_for_admission(self.waiting)
        while self.waiting and budget > 0 and self._has_seat(self.waiting[0]):
            request = self.waiting[0]
            # A tier load writes a block now: never while this step's swap-outs still read freed ones
            # (none today: nothing is admitted in a step that preempted).
            computed = bm.get_computed_blocks(request.all_token_ids, load=not out.blocks_to_swap_out)
            num_computed = len(computed) * bm.block_size
            num_new = request.num_tokens - num_computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            # The watermark keeps room for running requests to grow; with none running it would
            # only stop a request that fits the pool alone from ever starting.
            if not bm.can_allocate(request.request_id, num_computed + num_new, computed, reserve=bool(self.running)):
                break
            self.waiting.pop(0)
            request.timings.setdefault("scheduled", time.time())  # first admission: ends the queueing time
            bm.allocate(request.request_id, num_computed + num_new, computed)
            request.num_computed_tokens = request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, num_new)
            budget -= num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)
        # Its copy-on-writes of this step are freed or swapped out with it: cancel them.
        undo = out.cancel_copies(bm.block_ids(request.request_id))
        if bm.num_host_blocks and bm.can_swap_out(request.request_id):
            # Swap-outs read the blocks as they were at the start of the step: a copy-on-write
            # this step had not filled its copy yet, so the host gets the original.
            out.blocks_to_swap_out.extend((undo.get(d, d), h) for d, h in bm.swap_out(request.request_id))
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=queue_order)
        else:
            bm.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=queue_order)

    def _has_seat(self, request: Request, *, receiving: bool = False) -> bool:
        """Room under `max_num_seqs` for the request's sequences (n for a parent)."""
        return self._num_seqs(receiving=receiving) + request.params.n <= self.config.max_num_seqs

    def _num_seqs(self, *, receiving: bool = False) -> int:
        """Sequences in the running batch (with `receiving`, also those joining it once their KV
        is in): a parent not yet forked counts as its n choices."""
        num = len(self.running) + (len(self.receiving_kv) if receiving else 0)
        counted = (RequestStatus.RUNNING, RequestStatus.RECEIVING_KV) if receiving else (RequestStatus.RUNNING,)
        for parent in self.parents.values():  # none without n > 1, few with: a parent forks at its first draw
            if parent.status in counted:
                num += parent.params.n - 1
        return num
