"""Iteration-level scheduling (pure Python, numpy for the columnar decode step).

Each step, in this order:
  1. Running requests (decodes and unfinished chunked prefills), oldest first, each gets its
     next tokens from the token budget. When blocks run out, the lowest-priority, latest-arrived
     running request is preempted: swapped to host blocks when swap space allows, else its
     blocks are freed and it is recomputed later. It may be the request being scheduled.
  2. If nothing was preempted: swapped requests come back in, then waiting requests are admitted
     in the scheduling policy's order (engine/scheduling_policy.py: fcfs, priority, or shortest
     job first with aging, which re-sorts a queue before admitting from it) while `max_num_seqs`,
     the token budget and free blocks (less the watermark) allow. A prompt longer than the budget
     is split over steps (chunked prefill).
The result is one `SchedulerOutput` (engine/scheduler_output.py), the only thing the model
runner sees. After the forward, `postprocess` advances the requests, appends sampled tokens and
retires finished requests. A steady decode (every running request decoding one token, nothing to
admit) is scheduled and postprocessed as columns instead (`_schedule_decode`, engine/decode_batch.py);
the general path above stays the definition, and anything it would do differently sends the step
back to it.

A decode node's requests arrive with their prompt KV computed elsewhere (vLLM's
WAITING_FOR_REMOTE_KVS). The scheduler owns those states too, and the blocks they hold:

    add_remote ─▶ WAITING_FOR_KV ──schedule_remote_kv──▶ RECEIVING_KV ──remote_kv_done──▶ RUNNING
                  (no blocks; arrival   (blocks allocated here for the    (joins the batch: prompt KV
                   order)                prompt; the node pulls into them)  computed, first token fed next)
                  remote_kv_failed / abort, from either state ─▶ FINISHED_ABORTED, blocks freed

`schedule_remote_kv` starts pulls in the policy's order (arrival order, but for sjf) while
`max_num_seqs` (running + receiving) and free blocks allow, keeping the watermark back unless
nothing runs or receives.

Parallel sampling (n > 1): the fork point is the parent's first draw. `postprocess` (or, on a
decode node, `remote_kv_done` with the first tokens the prefill node drew) replaces the parent
with its n children, which share its blocks (`BlockManager.fork`); a child's first write into a
shared block is a copy-on-write (`blocks_to_copy`). A parent not yet forked counts as n
sequences against `max_num_seqs` (`_num_seqs`). `abort(parent id)` aborts every child still held.

Speculative decoding (`num_lookahead_tokens` = k > 0): a decode step gets up to k more slots for
draft tokens, counted against the token budget, when blocks allow (else it decodes plainly:
drafts never cause a preemption). `postprocess` appends the tokens the verification emitted,
counts the accepted drafts' KV as computed and frees the blocks past it (rejected slots).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat

import numpy as np

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decode_batch import DecodeBatch, DecodeStep
from pdserve.engine.request import FINISHED, Request, RequestStatus
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.engine.scheduling_policy import (
    DEFAULT_SCHEDULING_POLICY,
    DEFAULT_SJF_AGING_S,
    DEFAULT_SJF_LENGTH_FACTOR,
    SchedulingPolicy,
)
from pdserve.engine.spec_decode.stats import SpecDecodeStats


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY  # fcfs | priority | sjf (engine/scheduling_policy.py)
    sjf_length_factor: float = DEFAULT_SJF_LENGTH_FACTOR  # sjf: estimate = min(prompt len x factor, max_tokens)
    sjf_aging_s: float = DEFAULT_SJF_AGING_S  # sjf: a request that waited this long is no longer overtaken
    num_lookahead_tokens: int = 0  # speculative decoding: draft slots per decode step (k; 0 = off)

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.scheduling_policy, self.sjf_length_factor, self.sjf_aging_s)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or no long prompt could ever be scheduled"
            )


def _order(request: Request) -> tuple[int, int]:
    return (request.priority, request.arrival_seq)


def _read_columns(requests: list[Request], ids: list[str], tables: dict[str, list[int]]):
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


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: Iterable[int] = ()):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = config.policy
        self.clock = time.monotonic  # the time sjf's aging reads (tests put a fake clock here)
        self.waiting: list[Request] = []  # sorted by (priority, arrival); sjf re-sorts it to admit
        self.running: list[Request] = []  # admission order
        self.swapped: list[Request] = []  # sorted by (priority, arrival); sjf re-sorts it to admit
        self.waiting_for_kv: list[Request] = []  # remote KV announced, no blocks: arrival order (sjf: re-sorted)
        self.receiving_kv: dict[str, Request] = {}  # blocks allocated, the node copies the KV in
        self.requests: dict[str, Request] = {}  # every request held, remote-KV states included
        self.parents: dict[str, Request] = {}  # n > 1 requests held that have not forked yet (few)
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt positions whose KV a forward computed here (totals)
        self.num_tokens_sampled = 0
        self.spec_stats = SpecDecodeStats()  # speculative decoding: drafts verified and accepted
        # Steady decode steps as columns (engine/decode_batch.py); False: every step takes the
        # general path (the tests compare the two).
        self.decode_columns = True
        self._decode_batch: DecodeBatch | None = None  # the running batch's constants, as columns

    # ---- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check_new(request)
        self.policy.check_priority(request)
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_tokens} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self._hold(request)
        bisect.insort(self.waiting, request, key=_order)

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")

    def _hold(self, request: Request) -> None:
        """Start holding a new request (an n > 1 one is a parent until it forks)."""
        self.requests[request.request_id] = request
        if request.forks:
            self.parents[request.request_id] = request

    # ---- remote KV (decode node) ----------------------------------------------------------
    def add_remote(self, request: Request) -> None:
        """Queue a request whose prompt KV another node computed (its first token already
        appended): it waits, holding no block, until `schedule_remote_kv` finds room for it."""
        self._check_new(request)
        request.status = RequestStatus.WAITING_FOR_KV
        self._hold(request)
        self.waiting_for_kv.append(request)

    def schedule_remote_kv(self, *, arrived_before: float | None = None) -> list[Request]:
        """Allocate prompt blocks for waiting remote-KV requests, in arrival order, while the batch
        and the pool allow; they move to RECEIVING_KV and are returned: the caller pulls their KV
        into `block_manager.block_ids(request_id)`. `arrived_before` (a monotonic time) holds back
        requests that arrived later (the fault-injection hook's simulated slow network)."""
        bm = self.block_manager
        started = []
        self._sort_for_admission(self.waiting_for_kv, receiving=True)
        while self.waiting_for_kv:
            request = self.waiting_for_kv[0]
            room = self._has_seat(request, receiving=True)
            # As for waiting requests: no watermark on a pool nothing else will grow into.
            reserve = bool(self.running or self.receiving_kv)
            if not room or not bm.can_allocate(request.request_id, request.num_prompt_tokens, reserve=reserve):
                break
            if arrived_before is not None and request.arrival_time > arrived_before:
                break
            self.waiting_for_kv.pop(0)
            bm.allocate(request.request_id, request.num_prompt_tokens)
            request.status = RequestStatus.RECEIVING_KV
            request.kv_pull_started_at = time.monotonic()
            self.receiving_kv[request.request_id] = request
            started.append(request)
        return started

    def remote_kv_done(self, request_id: str) -> Request | None:
        """The request's KV is in its blocks: it joins the running batch (prompt KV computed, the
        first output token not yet fed back). None when it is no longer receiving (aborted)."""
        request = self.receiving_kv.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.forks:  # the prefill node drew each choice's first token: fork here
            children = self._fork(request)
            for child, (token_id, logprobs) in zip(children, request.choice_first_tokens, strict=True):
                self._accept(child, token_id, logprobs, sampled_here=False)
        return request

    def remote_kv_failed(self, request_id: str) -> Request | None:
        """Give up a request still waiting for or receiving its KV: its blocks are freed. None when
        no such request is held here."""
        request = self.requests.get(request_id)
        if request is None or not request.status.is_remote_kv:
            return None
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self.waiting_for_kv)

    @property
    def num_receiving_kv(self) -> int:
        return len(self.receiving_kv)

    def detach(self, request: Request) -> list[int]:
        """Take a running request out of scheduling but leave its blocks allocated: the caller now
        owns them (a prefill node pins them under a lease until the decode node has copied them)
        and must call `block_manager.free(request_id)` exactly once."""
        self.running.remove(request)
        self.requests.pop(request.request_id, None)
        self.parents.pop(request.request_id, None)
        request.status = RequestStatus.TRANSFERRING
        return self.block_manager.block_ids(request.request_id)

    def abort(self, request_id: str) -> list[Request]:
        """Abort a request; given the id of an n > 1 request that forked, every choice still held.
        Returns the requests aborted (none when nothing is held under that id)."""
        request = self.requests.get(request_id)
        family = [request] if request is not None else [r for r in self.requests.values() if r.parent_id == request_id]
        for r in family:
            self.finish(r, RequestStatus.FINISHED_ABORTED)
        return family

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request and release everything it holds (device and host blocks)."""
        for queue in (self.waiting, self.running, self.swapped, self.waiting_for_kv):
            if request in queue:
                queue.remove(request)
        self.receiving_kv.pop(request.request_id, None)
        self.block_manager.free(request.request_id)
        self.block_manager.free_host(request.request_id)
        request.status = status
        self.requests.pop(request.request_id, None)
        self.parents.pop(request.request_id, None)

    def has_unfinished(self) -> bool:
        """Any request held, remote-KV states included."""
        return bool(self.requests)

    def has_runnable(self) -> bool:
        """A request a step can schedule (waiting, running or swapped)."""
        return bool(self.waiting or self.running or self.swapped)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        batch, carried = self._decode_batch, None
        if batch is not None:  # its columns hold for the step right after its own only
            carried, batch.carried = batch.carried, None
        decode = self._schedule_decode(carried) if self.decode_columns else None
        if decode is not None:
            out.decode, out.num_batched_tokens = decode, len(decode)
            return out
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_request_ids:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm, running, drafting = self.block_manager, self.running, self.config.num_lookahead_tokens > 0
        tables, forked, block_size, scheduled = bm.tables, bm.forked, bm.block_size, out.scheduled
        i = 0
        while i < len(running) and budget > 0:  # per request of the batch: kept lean (a call costs ~0.2 us)
            request = running[i]
            request_id, computed, num_tokens = request.request_id, request.num_computed_tokens, len(request.all_token_ids)
            num_new = min(num_tokens - computed, budget)
            lookahead = self._lookahead(request, num_new, budget) if drafting else 0
            target = computed + num_new + lookahead
            table = tables.get(request_id)
            # bm.holds(request_id, target), inlined: most decode steps need no new or copied block
            if table is None or len(table) * block_size < target or request_id in forked:
                budget, i, preempted = self._grow(out, request, target, budget, i)
                if preempted:
                    continue
                table = tables[request_id]
            # (request, num_computed_tokens, num_new_tokens, block_ids, samples): positional
            # arguments build it in half the time of keywords
            item = ScheduledRequest(request, computed, num_new, table, computed + num_new == num_tokens)
            if lookahead:
                item.num_lookahead_tokens = lookahead
            scheduled.append(item)
            budget -= num_new + lookahead
            i += 1
        return budget

    def _schedule_decode(self, carried: tuple | None) -> DecodeStep | None:
        """The step as columns when it is a steady decode: every running request decoding one
        token, nothing to admit, no drafts, forks or copy-on-writes, room for every new block.
        None: the general path decides the step (it gives the same step where this one applies;
        blocks this one allocated before finding it does not are what the general path would
        allocate first, in the same order). `carried`: the columns the last step's postprocess
        left (positions, token ids, block counts), when that step was a columnar one: nothing but
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
        batch = self._decode_batch
        if batch is None or batch.requests != running:  # compares identities: a few ns a request
            batch, carried = DecodeBatch.following(batch, running, self.eos_token_ids, carried)
            self._decode_batch = batch
        ids, tables = batch.request_ids, bm.tables
        num_carried = 0 if carried is None else len(carried[0])
        read = _read_columns(running[num_carried:], ids[num_carried:], tables) if num_carried < len(running) else None
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
                return None  # a copy-on-write: the general path's
        grown = np.flatnonzero(positions >= num_blocks * bm.block_size).tolist()  # one request in block_size
        for i in grown:
            target = int(positions[i]) + 1
            if not bm.can_allocate(ids[i], target, write_from=target - 1):
                return None  # a preemption: the general path's
            num_blocks[i] = len(bm.allocate(ids[i], target))
        return DecodeStep(batch, positions, token_ids, num_blocks, grown, tables, num_carried)

    def _grow(self, out: SchedulerOutput, request: Request, target: int, budget: int, i: int) -> tuple[int, int, bool]:
        """Give running[i] blocks (and copy-on-writes) for `target` tokens, preempting the
        lowest-priority running requests until they fit. Returns (budget, i, whether `request`
        itself was preempted): a victim scheduled earlier in this step is un-scheduled."""
        bm = self.block_manager
        while not bm.can_allocate(request.request_id, target, write_from=request.num_computed_tokens):
            victim = max(self.running, key=_order)
            if self.running.index(victim) < i:
                budget += self._unschedule(out, victim)
                i -= 1
            self._preempt(victim, out)
            if victim is request:
                return budget, i, True
        bm.allocate(request.request_id, target)
        out.blocks_to_copy.extend(bm.copy_on_write(request.request_id, request.num_computed_tokens, target))
        return budget, i, False

    def _lookahead(self, request: Request, num_new: int, budget: int) -> int:
        """Draft slots for a decode step: k, less what max_tokens, max_model_len or the token
        budget leave no room for (the verification emits up to lookahead + 1 tokens); none when
        blocks are short (drafts never cause a preemption: the step decodes plainly first)."""
        if num_new != 1 or request.num_tokens - request.num_computed_tokens != 1 or request.forks:
            return 0
        room_out = request.params.max_tokens - request.num_output_tokens - 1
        room_len = self.config.max_model_len - request.num_tokens - 1
        num_slots = max(0, min(self.config.num_lookahead_tokens, budget - 1, room_out, room_len))
        if num_slots and not self.block_manager.can_allocate(
                request.request_id, request.num_tokens + num_slots, write_from=request.num_computed_tokens):
            return 0
        return num_slots

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        item = next(s for s in out.scheduled if s.request is request)
        out.scheduled.remove(item)
        return item.num_new_tokens + item.num_lookahead_tokens

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
            computed = bm.get_computed_blocks(request.all_token_ids)
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

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int, num_lookahead: int = 0) -> None:
        start = request.num_computed_tokens
        out.scheduled.append(ScheduledRequest(
            request=request, num_computed_tokens=start, num_new_tokens=num_new,
            block_ids=self.block_manager.block_ids(request.request_id),
            samples=start + num_new == request.num_tokens, num_lookahead_tokens=num_lookahead,
        ))

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
            bisect.insort(self.swapped, request, key=_order)
        else:
            bm.free(request.request_id)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            bisect.insort(self.waiting, request, key=_order)

    # ---- after the forward --------------------------------------------------------------
    def postprocess(
        self, out: SchedulerOutput, sampled: dict[str, tuple[int, dict[int, float] | None]]
    ) -> list[Request]:
        """Advance every scheduled request; `sampled` maps request id → (token, logprobs) for
        those that sampled. Returns the requests that finished this step (blocks released), and
        lists in `out.stepped` every request that got new tokens (an n > 1 parent's children)."""
        if out.decode is not None:
            return self._postprocess_decode(out, sampled)
        finished, stepped = [], out.stepped
        bm = self.block_manager
        caching, keys, block_size = bm.enable_prefix_caching, bm.keys, bm.block_size
        for item in out.scheduled:  # per request of the batch: kept lean (a call costs ~0.2 us here)
            request = item.request
            if request.status in FINISHED:  # aborted while the step ran: reported, nothing appended
                if item.samples and not request.forks:
                    stepped.append(request)
                continue
            start = item.num_computed_tokens
            request.num_computed_tokens = computed = start + item.num_new_tokens
            if start < len(request.prompt_token_ids):  # a prompt chunk, not a decode
                self.num_prompt_tokens_computed += min(computed, request.num_prompt_tokens) - start
            # cache_full_blocks' own early exit, without the call: no block became full (most steps)
            if caching and len(keys.get(request.request_id, ())) < computed // block_size:
                bm.cache_full_blocks(request.request_id, request.all_token_ids, computed)
            if not item.samples:
                continue
            if request.forks:
                out.forked[request.request_id] = children = self._fork(request)
                for child in children:
                    if self._accept(child, *sampled[child.request_id]):
                        finished.append(child)
                stepped += children
                continue
            stepped.append(request)
            if item.num_lookahead_tokens:
                if self._accept_verified(item, sampled[request.request_id]):
                    finished.append(request)
                continue
            token_id, logprobs = sampled[request.request_id]
            if self._accept(request, token_id, logprobs):
                finished.append(request)
        return finished

    def _postprocess_decode(self, out: SchedulerOutput, sampled) -> list[Request]:
        """`postprocess` of a columnar decode step; `sampled` is (token ids [S] as a list or int64
        array, logprobs [S] or None) in batch order (ModelRunner's decode sampling), or the
        general path's mapping."""
        decode = out.decode
        batch, requests = decode.batch, decode.requests
        if isinstance(sampled, dict) or self.running != requests:  # a request left while the step ran
            if not isinstance(sampled, dict):
                token_ids = np.asarray(sampled[0], dtype=np.int64).tolist()  # Python ints in the outputs
                sampled = dict(zip(batch.request_ids, zip(token_ids, sampled[1] or repeat(None))))
            out.decode = None
            out.items = decode.items()
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

    def _accept_verified(self, item: ScheduledRequest, emitted) -> bool:
        """A speculative step emitted its accepted drafts and one token of the target's: append
        them, each with its stop check; the accepted drafts' KV counts as computed, and the slots
        of rejected drafts roll back (blocks past the computed KV are freed). True when finished."""
        request, bm = item.request, self.block_manager
        emitted = emitted if isinstance(emitted, list) else [emitted]
        self.spec_stats.observe(len(item.spec_token_ids), len(emitted) - 1)
        for num_new, (token_id, logprobs) in enumerate(emitted, 1):
            finished = self._accept(request, token_id, logprobs)
            request.num_new_output_tokens = num_new
            if finished:
                return True
        request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens + len(emitted) - 1
        bm.cache_full_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens)
        bm.trim(request.request_id, request.num_computed_tokens)
        return False

    def _accept(self, request: Request, token_id: int, logprobs: dict[int, float] | None, *,
                sampled_here: bool = True) -> bool:
        """Append a sampled token; True when it ended the request (blocks released): EOS, a stop
        token id, max_tokens or max_model_len. (Stop strings need text: the engine checks them.)"""
        request.output_token_ids.append(token_id)  # request.append_output, inlined: every request, every step
        request.all_token_ids.append(token_id)
        if logprobs is not None:
            request.output_logprobs.append(logprobs)
        request.num_new_output_tokens = 1
        self.num_tokens_sampled += sampled_here
        return self._check_stop(request, token_id)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """After `token_id` was appended: finish the request (blocks released) and return True
        when it ended it: EOS, a stop token id, max_tokens or max_model_len."""
        params = request.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        elif (len(request.output_token_ids) >= params.max_tokens
              or len(request.all_token_ids) >= self.config.max_model_len):
            self.finish(request, RequestStatus.FINISHED_LENGTH)
        else:
            return False
        return True

    def _fork(self, parent: Request) -> list[Request]:
        """Replace the running `parent` by its n children, in its place in the batch order; they
        share its blocks (its own references are dropped). The caller gives them first tokens."""
        bm = self.block_manager
        children = [parent.fork(i) for i in range(parent.params.n)]
        for child in children:
            self._check_new(child)
        at = self.running.index(parent)
        self.running[at : at + 1] = children
        del self.requests[parent.request_id]
        self.parents.pop(parent.request_id, None)
        for child in children:
            self.requests[child.request_id] = child
            bm.fork(parent.request_id, child.request_id)
        bm.free(parent.request_id)
        return children

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
