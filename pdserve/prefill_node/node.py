"""The prefill node: admit prompts, prefill them in chunked batches, sample the first token,
send it to the router at once, then hand the KV to the decode node the router chose.

A request's states here:

    PrefillRequest ─▶ WAITING ─▶ RUNNING (chunks) ─▶ first token sampled ─▶ FirstToken → router
        ├─ the first token ends it (EOS, max_tokens=1) ─▶ finished; blocks released by the scheduler
        ├─ colocated (no decode node named) ─▶ keeps RUNNING here; tokens stream as TokenBatch
        └─ TRANSFERRING: detached from the scheduler, blocks pinned under a lease, KVReady → decode
              └─ KVDone / lease expiry / Abort ─▶ `_release` frees the blocks exactly once
                 (they stay in the prefix cache until evicted)

What the node holds for each request is its entry in `self.requests` (node/requests.py): its
stage (PREFILLING, COLOCATED, HANDED_OFF), the PrefillRequest (where its KV goes), the KVReady
sent, its router, its timings. Every path that lets a request go forgets it there: its first
token ends it, a colocated request finishes, an abort (from its router, or its router gone),
a refusal, the lease released.

Ownership: the scheduler owns a request's blocks until `detach`; from then on the KVSender's
lease table owns them and calls `_release` once, which frees them and forgets the request. With
tensor parallelism the block ids are the same on every rank: one release frees the request's KV
on all of them, whatever the decode node's TP size (the sender serves each decode rank its heads
from the ranks holding them). A failed hand-off is reported to the router before the release.

Admission, first tokens and the colocated path are node/local_requests.py's (a decode node's
local prefill shares them). While a role change is pending (`switching`, node/role_switch.py)
heartbeats say not ready and new PrefillRequests are refused (retryable); `give_up` lets go of
what is left when the change times out. Every engine step is recorded for the heartbeats
(`steps`, node/step_samples.py); heartbeats name the role (`role`).

n > 1 (parallel sampling): the prompt is prefilled once and its step draws every choice's first
token; the engine forks the request into choices `{id}#{i}`, each reported in its own FirstToken.
Handed off, the choices are detached and their shared blocks go back under the request id
(`BlockManager.fork`): one KVReady carrying every choice's first token, one transfer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.node.faults import FaultInjection
from pdserve.node.kv_events import KVEventPublisher
from pdserve.node.local_requests import LocalRequests
from pdserve.node.metrics import NodeMetrics, NodeSnapshot, engine_snapshot
from pdserve.node.requests import NodeRequests, Stage, table_of
from pdserve.node.router_link import RouterLink
from pdserve.node.step_samples import StepSamples
from pdserve.protocol.messages import (
    Abort,
    Error,
    Heartbeat,
    KVReady,
    Message,
    PrefillRequest,
    SetRole,
    TokenBatch,
)

if TYPE_CHECKING:
    from pdserve.kvtransfer.sender import KVSender

logger = logging.getLogger(__name__)


# make_sender(release, on_error) -> KVSender: release(request_id) frees a handed-off request's
# blocks (the sender's lease table calls it once); on_error(request_id, message) reports a failed hand-off.
SenderFactory = Callable[[Callable[[str], None], Callable[[str, str], None]], "KVSender"]


class PrefillNode:
    def __init__(self, engine: LLMEngine, link: RouterLink, *, role: str = "prefill",
                 make_sender: SenderFactory | None = None, max_queue_len: int = 1024,
                 faults: FaultInjection | None = None, metrics: NodeMetrics | None = None,
                 requests: NodeRequests | None = None) -> None:
        self.engine = engine
        self.link = link
        self.role = role  # "prefill", or "both" for the colocated comparison mode
        self.node_id = link.register_msg.node_id
        self.requests = requests if requests is not None else table_of(link)  # what it holds, per request
        self.draining = False
        # A role change is pending (node/role_switch.py): not ready, new requests refused (retryable).
        self.switching = False
        self.on_set_role: Callable[[SetRole], None] | None = None  # None: a fixed-role node ignores SetRole
        self.faults = faults  # tests and chaos runs only
        # Prefill and the colocated path (admit, first tokens, decoding here): node/local_requests.py
        self.local = LocalRequests(engine, link, self.requests, self.node_id, max_queue_len=max_queue_len)
        self.steps: StepSamples = getattr(link, "step_samples", None) or StepSamples()  # for the heartbeats
        # What its prefix cache stores and evicts, to every router (node/kv_events.py).
        self.kv_events = KVEventPublisher(engine.scheduler.block_manager, self.node_id)
        self.metrics = metrics if metrics is not None else NodeMetrics(self.node_id, role)
        self.metrics.watch(self.metrics_snapshot)
        # KVSender (None when colocated only); it calls back into this node, so it is made here, last.
        self.sender = make_sender(self._release, self._handoff_failed) if make_sender is not None else None

    # ---- the loop ---------------------------------------------------------------------------
    def run_once(self) -> None:
        busy = self.engine.has_unfinished()
        for msg in self.link.poll(0 if busy else 5):
            self.handle(msg)
        if self.sender is not None:
            self.sender.poll(0)
        if self.engine.has_unfinished():
            self._step()
        self.link.maybe_heartbeat(self.heartbeat)
        self.kv_events.publish(self.link)

    def is_idle(self) -> bool:
        return len(self.requests) == 0

    @property
    def max_queue_len(self) -> int:
        return self.local.max_queue_len

    def handle(self, msg: Message) -> None:
        if isinstance(msg, PrefillRequest):
            self._admit(msg)
        elif isinstance(msg, Abort):
            self.abort(msg.request_id)
        elif isinstance(msg, SetRole):
            if self.on_set_role is not None:
                self.on_set_role(msg)
            else:
                logger.warning("%s serves %s only (started fixed-role): SetRole(%s) ignored", self.node_id, self.role,
                               msg.role)
        else:
            logger.warning("prefill node: unexpected %s from the router", msg.TYPE)

    def _admit(self, msg: PrefillRequest) -> None:
        if self.switching:  # finishing what it holds before it serves another role: the router retries it
            self._refuse(msg.request_id, f"node {self.node_id} is changing role", retryable=True)
            return
        self.local.admit(msg)

    def _refuse(self, request_id: str, message: str, *, retryable: bool = False) -> None:
        self.local.refuse(request_id, message, retryable=retryable)

    def abort(self, request_id: str) -> None:
        """Let the request go: out of the engine (an n > 1 request: each of its choices), or, handed
        off, its lease released (`_release` frees the blocks); forgotten either way."""
        self.engine.abort(request_id)
        if self.requests.stage(request_id) is Stage.HANDED_OFF:
            self.sender.abort(request_id)
        for rid in self.requests.family(request_id):
            self.requests.forget(rid)

    def give_up(self, message: str) -> None:
        """Let go of everything held (a role change that timed out): each request in the engine
        aborted, its router told with a retryable Error (it re-dispatches); a handed-off request's
        lease released (its decode node's transfer fails and reports it, so no Error from here)."""
        for rid in list(self.requests.held_ids()):
            stage = self.requests.stage(rid)
            if stage is None:
                continue  # went with its family
            if stage is Stage.HANDED_OFF:
                self.sender.abort(rid)  # `_release` frees and forgets it
                continue
            self.link.send(Error(request_id=rid, node_id=self.node_id, message=message, retryable=True))
            self.abort(rid)

    # ---- one engine step --------------------------------------------------------------------
    def _step(self) -> None:
        if self.faults is not None:
            self.faults.delay_step()
        stepped = self.steps.step(self.engine)
        # colocated decodes' tokens, and request id → it, or its n > 1 choices just forked: first tokens
        tokens, finished, first_tokens = self.local.sort_step(stepped)
        for rid, requests in first_tokens.items():
            self._first_tokens(rid, requests)
        if tokens:
            self.link.send(TokenBatch.from_tokens(self.node_id, tokens))
        for rid in finished:  # once its last token is on its way to its router
            self.requests.forget(rid)

    def _first_tokens(self, rid: str, requests: list[Request]) -> None:
        """Request `rid` sampled its first token (`requests` = [it], or its n > 1 choices): each
        to the router, then, unless that ended it, its KV to the decode node (once for all the
        choices), or it decodes here (colocated)."""
        msg = self.requests.get(rid).handoff
        firsts, forked = self.local.send_first_tokens(rid, requests)
        live = [r for r in requests if not r.is_finished]
        if not live or not msg.decode_node_id:  # ended by its first token, or colocated: decodes here
            self.local.decode_here(rid, requests, forked)
            return
        if forked:  # their first tokens sent; the request id stands for them in the hand-off
            for choice in requests:
                self.requests.forget(choice.request_id)
        first = live[0]
        block_ids = [self.engine.scheduler.detach(r) for r in live][0]  # the choices' tables: the same blocks
        choices = {}
        if forked:  # the shared blocks go back under the request id, transferred once
            bm = self.engine.block_manager
            bm.fork(first.request_id, rid)
            for choice in live:
                bm.free(choice.request_id)
            choices = dict(choice_first_tokens=[tok for tok, _ in firsts], choice_first_logprobs=[lp for _, lp in firsts])
        ready = KVReady(
            request_id=rid, prompt_token_ids=first.prompt_token_ids, first_token=firsts[0][0],
            first_logprobs=firsts[0][1], sampling=msg.sampling, num_tokens=first.num_prompt_tokens,
            block_ids=list(block_ids), block_size=self.engine.config.block_size, lease_s=self.sender.lease_s,
            priority=first.priority, num_prior_output_tokens=first.num_prior_output_tokens,
            router=self.link.origin(rid), **choices,
        )
        self.requests.move(rid, Stage.HANDED_OFF, kv_ready=ready)
        self.sender.send(msg.decode_node_id, msg.decode_kv_addr, ready)
        self.requests.note(rid, "kv_ready_sent")  # unless the send already released it

    def _release(self, request_id: str) -> None:
        """The lease table's callback: the decode node has the KV (or never will)."""
        self.engine.block_manager.free(request_id)
        self.requests.note(request_id, "kv_released")
        self.requests.forget(request_id)

    def _handoff_failed(self, request_id: str, message: str) -> None:
        self.link.send(Error(request_id=request_id, node_id=self.node_id, message=message, retryable=True))

    # ---- reporting --------------------------------------------------------------------------
    def outstanding_tokens(self) -> int:
        """Prompt tokens queued or in progress (copies of the lists: the status thread reads this too)."""
        sched = self.engine.scheduler
        return sum(r.num_tokens - r.num_computed_tokens for r in [*sched.waiting, *sched.running])

    @property
    def ready(self) -> bool:
        """Taking new requests: not draining, not changing role."""
        return not self.draining and not self.switching

    def heartbeat(self) -> Heartbeat:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        outstanding = self.outstanding_tokens()
        return Heartbeat(
            node_id=self.node_id, num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_outstanding_tokens=outstanding, ready=self.ready,
            request_ids=self.requests.held_ids(), role=self.role,
        )

    def status(self) -> dict:
        bm = self.engine.block_manager
        return {
            "node_id": self.node_id, "role": self.role, "num_total_blocks": bm.num_blocks,
            "num_used_blocks": bm.num_used_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_running": len(self.engine.scheduler.running), "num_waiting": len(self.engine.scheduler.waiting),
            "num_leases": self.requests.num(Stage.HANDED_OFF),
            "prefix_cache_queries": bm.num_prefix_queries, "prefix_cache_hits": bm.num_prefix_hits,
            "num_preemptions": self.engine.scheduler.num_preemptions, "timings": list(self.requests.recent),
            "pid": os.getpid(),
        }

    def metrics_snapshot(self) -> NodeSnapshot:
        """Called from the status thread at scrape time: reads counters, changes nothing."""
        sender = self.sender
        return engine_snapshot(self.engine, num_bytes_sent=sender.num_bytes_sent if sender else 0,
                               num_leases=self.requests.num(Stage.HANDED_OFF),
                               num_outstanding_prompt_tokens=self.outstanding_tokens())
