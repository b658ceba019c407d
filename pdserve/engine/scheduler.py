"""Iteration-level scheduling (pure Python; numpy for decode steps).

Each step, in this order:
  1. Running requests (decodes and unfinished chunked prefills), oldest first, each gets its
     next tokens from the token budget. When blocks run out, the lowest-priority, latest-arrived
     running request is preempted (engine/scheduler_admission.py). It may be the request being
     scheduled.
  2. If nothing was preempted: swapped requests come back in, then waiting requests are admitted
     (engine/scheduler_admission.py) while `max_num_seqs`, the token budget and free blocks allow.
The result is one `SchedulerOutput` (engine/scheduler_output.py), the only thing the model
runner sees. After the forward, `postprocess` advances the requests, appends sampled tokens and
retires finished requests. A step in which the whole running batch decodes one token each is a
`DecodeStep` of columns (engine/decode_batch.py, engine/scheduler_decode.py); a steady one (nothing
to admit, no drafts, copy-on-write or preemption) is decided from the columns alone, before the
steps above.

A decode node's remote-KV states, and a prefill node's hand-off, are engine/scheduler_remote_kv.py.

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

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decode_batch import DecodeBatch
from pdserve.engine.request import FINISHED, Request, RequestStatus
from pdserve.engine.scheduler_admission import Admission, queue_order
from pdserve.engine.scheduler_config import SchedulerConfig
from pdserve.engine.scheduler_decode import DecodeScheduling
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.engine.scheduler_remote_kv import RemoteKV
from pdserve.engine.spec_decode.stats import SpecDecodeStats

__all__ = ["Scheduler", "SchedulerConfig"]


class Scheduler(Admission, DecodeScheduling, RemoteKV):
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
        bisect.insort(self.waiting, request, key=queue_order)

    def _check_new(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")

    def _hold(self, request: Request) -> None:
        """Start holding a new request (an n > 1 one is a parent until it forks)."""
        self.requests[request.request_id] = request
        if request.forks:
            self.parents[request.request_id] = request

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
        decode = self._schedule_decode(carried)
        if decode is None:
            budget = self._schedule_running(out, self.config.max_num_batched_tokens)
            if not out.preempted_request_ids:
                budget = self._schedule_swapped(out, budget)
                if not self.swapped:
                    self._schedule_waiting(out, budget)
            out.num_batched_tokens = sum(s.num_new_tokens for s in out.items)
            self._decode_from_items(out)
        else:
            out.decode, out.num_batched_tokens = decode, len(decode)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm, running, drafting = self.block_manager, self.running, self.config.num_lookahead_tokens > 0
        tables, forked, block_size, scheduled = bm.tables, bm.forked, bm.block_size, out.scheduled
        i = 0
        while i < len(running) and budget > 0:  # per request of the batch, every step: kept lean
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

    def _grow(self, out: SchedulerOutput, request: Request, target: int, budget: int, i: int) -> tuple[int, int, bool]:
        """Give running[i] blocks (and copy-on-writes) for `target` tokens, preempting the
        lowest-priority running requests until they fit. Returns (budget, i, whether `request`
        itself was preempted): a victim scheduled earlier in this step is un-scheduled."""
        bm = self.block_manager
        while not bm.can_allocate(request.request_id, target, write_from=request.num_computed_tokens):
            victim = max(self.running, key=queue_order)
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

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int, num_lookahead: int = 0) -> None:
        start = request.num_computed_tokens
        out.scheduled.append(ScheduledRequest(
            request=request, num_computed_tokens=start, num_new_tokens=num_new,
            block_ids=self.block_manager.block_ids(request.request_id),
            samples=start + num_new == request.num_tokens, num_lookahead_tokens=num_lookahead,
        ))

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
        for item in out.scheduled:  # per request of the batch, every step: kept lean
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
