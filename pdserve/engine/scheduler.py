"""Iteration-level scheduling (pure Python).

Each step, in this order:
  1. Running requests (decodes and unfinished chunked prefills), oldest first, each gets its
     next tokens from the token budget. When blocks run out, the lowest-priority, latest-arrived
     running request is preempted: swapped to host blocks when swap space allows, else its
     blocks are freed and it is recomputed later. It may be the request being scheduled.
  2. If nothing was preempted: swapped requests come back in, then waiting requests are admitted
     in (priority, arrival) order while `max_num_seqs`, the token budget and free blocks (less
     the watermark) allow. A prompt longer than the budget is split over steps (chunked prefill).
The result is one `SchedulerOutput`, the only thing the model runner sees. After the forward,
`postprocess` advances the requests, appends sampled tokens and retires finished requests.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # KV already in the blocks; this step's tokens start at this position
    num_new_tokens: int  # request.all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]
    block_ids: list[int]  # the request's block table (logical → physical), shared with the block manager
    samples: bool  # the chunk reaches the last known token: its logits give the next token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    num_batched_tokens: int = 0  # sum of num_new_tokens
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), before the forward
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), after swap-outs
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
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


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, eos_token_ids: Iterable[int] = ()):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # admission order
        self.swapped: list[Request] = []  # sorted by (priority, arrival)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_tokens} tokens leaves no room under "
                f"max_model_len={self.config.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_order)

    def add_prefilled(self, request: Request) -> None:
        """Admit a request whose prompt KV was computed elsewhere (a prefill node) and copied into
        blocks the caller already allocated under its id. It joins the running batch at once:
        prompt KV computed, the first output token not yet fed back."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if len(self.block_manager.block_ids(request.request_id)) < self.block_manager.num_blocks_for(
            request.num_prompt_tokens
        ):
            raise ValueError(f"request {request.request_id}: allocate its prompt blocks before add_prefilled")
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def detach(self, request: Request) -> list[int]:
        """Take a running request out of scheduling but leave its blocks allocated: the caller now
        owns them (a prefill node pins them under a lease until the decode node has copied them)
        and must call `block_manager.free(request_id)` exactly once."""
        self.running.remove(request)
        self.requests.pop(request.request_id, None)
        request.status = RequestStatus.TRANSFERRING
        return self.block_manager.block_ids(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request and release everything it holds (device and host blocks)."""
        for queue in (self.waiting, self.running, self.swapped):
            if request in queue:
                queue.remove(request)
        self.block_manager.free(request.request_id)
        self.block_manager.free_host(request.request_id)
        request.status = status
        self.requests.pop(request.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_request_ids:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            target = request.num_computed_tokens + num_new
            while not bm.can_allocate(request.request_id, target):
                # The victim may have been scheduled earlier in this step: un-schedule it.
                victim = max(self.running, key=_order)
                if self.running.index(victim) < i:
                    budget += self._unschedule(out, victim)
                    i -= 1
                self._preempt(victim, out)
                if victim is request:
                    break
            else:
                bm.allocate(request.request_id, target)
                self._add_scheduled(out, request, num_new)
                budget -= num_new
                i += 1
        return budget

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        item = next(s for s in out.scheduled if s.request is request)
        out.scheduled.remove(item)
        return item.num_new_tokens

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        bm = self.block_manager
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
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

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=start,
                num_new_tokens=num_new,
                block_ids=self.block_manager.block_ids(request.request_id),
                samples=start + num_new == request.num_tokens,
            )
        )

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        bm = self.block_manager
        self.running.remove(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_request_ids.append(request.request_id)
        if bm.num_host_blocks and bm.can_swap_out(request.request_id):
            out.blocks_to_swap_out.extend(bm.swap_out(request.request_id))
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
        those that sampled. Returns the requests that finished this step (blocks released)."""
        finished = []
        for item in out.scheduled:
            request = item.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens
            self.block_manager.cache_full_blocks(
                request.request_id, request.all_token_ids, request.num_computed_tokens
            )
            if not item.samples:
                continue
            token_id, logprobs = sampled[request.request_id]
            request.append_output(token_id, logprobs)
            status = self.check_stop(request)
            if status is not None:
                self.finish(request, status)
                finished.append(request)
        return finished

    def check_stop(self, request: Request) -> RequestStatus | None:
        """EOS, stop token ids, max_tokens, max_model_len. (Stop strings need text: the caller.)"""
        params, last = request.params, request.output_token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
