"""KV computed on another node: the scheduler's remote-KV states of a decode node, and the hand-off
of a prefill node's finished prompt (a mixin of `Scheduler`, engine/scheduler.py).

A decode node's requests arrive with their prompt KV computed elsewhere (vLLM's
WAITING_FOR_REMOTE_KVS). The scheduler owns those states too, and the blocks they hold:

    add_remote ─▶ WAITING_FOR_KV ──schedule_remote_kv──▶ RECEIVING_KV ──remote_kv_done──▶ RUNNING
                  (no blocks; arrival   (blocks allocated here for the    (joins the batch: prompt KV
                   order)                prompt; the node pulls into them)  computed, first token fed next)
                  remote_kv_failed / abort, from either state ─▶ FINISHED_ABORTED, blocks freed

A prompt whose leading blocks this node's prefix cache holds (a conversation's next turn, whose
history this node decoded) takes those blocks as hits, as a local prefill would, and only the
rest is pulled: `request.num_cached_tokens` says how many tokens the node already had.

`schedule_remote_kv` starts pulls in the policy's order (arrival order, but for sjf) while
`max_num_seqs` (running + receiving) and free blocks allow, keeping the watermark back unless
nothing runs or receives.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.block_manager import BlockManager


class RemoteKV:
    """Scheduler's part for KV that crosses nodes (a mixin: the state is the Scheduler's)."""

    block_manager: BlockManager
    running: list[Request]
    waiting_for_kv: list[Request]  # remote KV announced, no blocks: arrival order (sjf: re-sorted)
    receiving_kv: dict[str, Request]  # blocks allocated, the node copies the KV in
    requests: dict[str, Request]
    parents: dict[str, Request]

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
            if not room or (arrived_before is not None and request.arrival_time > arrived_before):
                break
            # As for waiting requests: no watermark on a pool nothing else will grow into.
            reserve = bool(self.running or self.receiving_kv)
            computed = bm.get_computed_blocks(request.prompt_token_ids) if request.kv_reuse_prefix else []
            if not bm.can_allocate(request.request_id, request.num_prompt_tokens, computed, reserve=reserve):
                break
            self.waiting_for_kv.pop(0)
            bm.allocate(request.request_id, request.num_prompt_tokens, computed)
            request.num_cached_tokens = len(computed) * bm.block_size
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
