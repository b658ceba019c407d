"""The decode node: take KV handed over by prefill nodes, then run continuous decode batching
and stream tokens to the router.

A request's states here (the scheduler's; the node only talks to the receiver):

    KVReady ─▶ WAITING_FOR_KV   scheduler.add_remote: no blocks yet; the lease is renewed every
               │                5 s while it waits (LeaseRenew)
               ▼ scheduler.schedule_remote_kv: room in the batch and blocks (watermark) allow
            RECEIVING_KV        blocks allocated here; receiver.pull copies the KV in
               │                (shared memory or ZMQ frames), into every tensor-parallel rank's
               │                pool (its heads, same block ids); DONE once every rank has its part
               ▼ receiver DONE ─▶ scheduler.remote_kv_done
            RUNNING             prompt KV computed, the first token fed back next step
               ▼
            finished (EOS, stop token, max_tokens; or Abort from the router)
    A preempted request is recomputed here (its prompt + outputs prefilled again) or swapped.
    Receiver FAILED ─▶ scheduler.remote_kv_failed (blocks freed) + a retryable Error to the router.

Local prefill: a PrefillRequest naming no decode node is prefilled here (node/local_requests.py,
shared with the colocated prefill node): admitted into the engine (queue full: a retryable
Error), chunk-prefilled among the running decodes under the scheduler's token budget, its first
token sent as FirstToken, then decoded as any other request (TokenBatch); n > 1 forks as on a
colocated node. One naming a decode node is refused, retryable (the router sends it to a
prefill node). The heartbeat's `num_outstanding_tokens` counts the prompt tokens still to
prefill here.

    PrefillRequest (no decode node) ─▶ PREFILLING (WAITING, RUNNING chunks) ─▶ FirstToken
        ─▶ COLOCATED (RUNNING, TokenBatch) ─▶ finished / aborted

While a role change is pending (`switching`, node/role_switch.py) heartbeats say not ready and
new PrefillRequests are refused (retryable); what it holds finishes (KV still to come included);
`give_up` lets go of what is left when the change times out. Every engine step is recorded for
the heartbeats (`steps`, node/step_samples.py); heartbeats name the role.

What the node holds for each request is its entry in `self.requests` (node/requests.py): its
stage (WAITING_FOR_KV, RECEIVING_KV, DECODING; PREFILLING, COLOCATED), the KVReady it came with, its router, its
timings; n > 1, once forked, each choice's. Every path that lets a request go forgets it there:
finished, aborted (by its router, or its router gone), refused, its transfer failed.

Ownership: blocks allocated for RECEIVING_KV belong to this node's block manager under the
request id, allocated and freed by the scheduler; on a failed transfer or an abort they are
freed here and the prefill node is told (KVDone ok=False, by the receiver) so it frees its own.
Once RUNNING, the scheduler owns them as any running request's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request, child_id
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.receiver import KVEventKind
from pdserve.node.faults import FaultInjection
from pdserve.node.kv_events import KVEventPublisher
from pdserve.node.local_requests import LocalRequests, outstanding_prompt_tokens
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

logger = logging.getLogger(__name__)

LEASE_RENEW_S = 5.0  # while a request waits for blocks, ask its prefill node to keep them this often


class DecodeNode:
    def __init__(self, engine: LLMEngine, link: RouterLink, receiver, *, max_queue_len: int = 1024,
                 faults: FaultInjection | None = None, metrics: NodeMetrics | None = None,
                 requests: NodeRequests | None = None) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.link = link
        self.receiver = receiver  # KVReceiver
        self.node_id = link.register_msg.node_id
        self.faults = faults  # tests and chaos runs only
        self.requests = requests if requests is not None else table_of(link)  # what it holds, per request
        self.role = "decode"
        self.draining = False
        # A role change is pending (node/role_switch.py): not ready, new PrefillRequests refused (retryable).
        self.switching = False
        self.on_set_role: Callable[[SetRole], None] | None = None  # None: a fixed-role node ignores SetRole
        self.max_queue_len = max_queue_len  # requests announced, waiting for blocks; past it, refused
        # Local prefill (a PrefillRequest naming no decode node), shared with the colocated prefill
        # node: admission (`max_queue_len` waiting in the engine), first tokens, decoding here.
        self.local = LocalRequests(engine, link, self.requests, self.node_id, max_queue_len=max_queue_len)
        self.steps: StepSamples = getattr(link, "step_samples", None) or StepSamples()  # for the heartbeats
        # What its prefix cache stores and evicts, to every router (node/kv_events.py).
        self.kv_events = KVEventPublisher(engine.scheduler.block_manager, self.node_id)
        self.metrics = metrics if metrics is not None else NodeMetrics(self.node_id, "decode")
        self.metrics.watch(self.metrics_snapshot)

    # ---- the loop ---------------------------------------------------------------------------
    def run_once(self) -> None:
        busy = self.scheduler.has_runnable() or bool(self.scheduler.num_receiving_kv)
        for msg in self.link.poll(0 if busy else 5):
            self.handle(msg)
        for event in self.receiver.poll(0):
            self._on_kv_event(event)
        self._start_pulls()
        if self.scheduler.has_runnable():
            self._step()
        self.link.maybe_heartbeat(self.heartbeat)
        self.kv_events.publish(self.link)

    def is_idle(self) -> bool:
        return len(self.requests) == 0  # remote-KV states included

    @property
    def ready(self) -> bool:
        """Taking new requests: not draining, not changing role."""
        return not self.draining and not self.switching

    def handle(self, msg: Message) -> None:
        if isinstance(msg, Abort):
            self.abort(msg.request_id)
        elif isinstance(msg, PrefillRequest):
            self._admit_local(msg)
        elif isinstance(msg, SetRole):
            if self.on_set_role is not None:
                self.on_set_role(msg)
            else:
                logger.warning("%s serves decode only (started fixed-role): SetRole(%s) ignored", self.node_id,
                               msg.role)
        else:
            logger.warning("decode node: unexpected %s from the router", msg.TYPE)
            request_id = getattr(msg, "request_id", None)
            if isinstance(request_id, str):  # a PrefillRequest, say: its origin was noted, nothing taken
                self.requests.forget_unadmitted(request_id)

    def _admit_local(self, msg: PrefillRequest) -> None:
        """A request to prefill here and decode here (no decode node named): into the engine, its
        prompt chunk-prefilled among the running decodes. One naming a decode node was meant for a
        prefill node (the router's view is stale): refused, retryable, so the router sends it on."""
        if msg.decode_node_id:
            self.local.refuse(msg.request_id, f"{self.node_id} is a decode node: it prefills only requests it "
                              f"decodes itself, not for {msg.decode_node_id}", retryable=True)
        elif self.switching:  # finishing what it holds before it serves another role: the router retries it
            self.local.refuse(msg.request_id, f"node {self.node_id} is changing role", retryable=True)
        else:
            self.local.admit(msg, queue_name="decode node's prefill")

    def abort(self, request_id: str) -> None:
        """Let the request go (an n > 1 request: each of its choices): its blocks freed, whatever
        its state, the prefill node told if its KV was still to come; forgotten."""
        remote_kv = self.requests.stage(request_id) in (Stage.WAITING_FOR_KV, Stage.RECEIVING_KV)
        self.engine.abort(request_id)
        if remote_kv:
            self.receiver.release(request_id, error="aborted")
        for rid in self.requests.family(request_id):
            self.requests.forget(rid)

    def give_up(self, message: str) -> None:
        """Let go of everything held (a role change that timed out): each request aborted (blocks
        freed, a prefill node told if its KV was still to come) and its router told with a
        retryable Error, so it re-dispatches it."""
        for rid in list(self.requests.held_ids()):
            if rid in self.requests:  # not gone with its family
                self.link.send(Error(request_id=rid, node_id=self.node_id, message=message, retryable=True))
                self.abort(rid)

    # ---- KV arrival -------------------------------------------------------------------------
    def _on_kv_event(self, event) -> None:
        rid = event.request_id
        if event.kind == KVEventKind.READY:
            self._on_ready(event.ready)
        elif event.kind == KVEventKind.DONE:
            request = self.scheduler.remote_kv_done(rid)
            if request is not None:
                request.timings["kv_done"] = time.time()
                self._transfer_done(request, event.num_bytes)
                self.requests.log(rid, request.timings)
                entry = self.requests.get(rid)
                if request.forks:  # forked: its choices stand for it, their tokens to its router
                    for i in range(request.params.n):
                        self.requests.admit(child_id(rid, i), Stage.DECODING, parent_id=rid, origin=entry.origin,
                                            kv_ready=entry.kv_ready)
                    self.requests.forget(rid)
                else:
                    self.requests.move(rid, Stage.DECODING)
        elif event.kind == KVEventKind.FAILED:
            self.scheduler.remote_kv_failed(rid)
            self.link.send(Error(request_id=rid, node_id=self.node_id, message=f"KV transfer failed: {event.error}",
                                 retryable=True))
            self.requests.forget(rid)

    def _on_ready(self, ready: KVReady) -> None:
        rid = ready.request_id
        self.link.adopt(rid, ready.router)  # its tokens and errors go back to that router
        if self.scheduler.num_waiting_for_kv >= self.max_queue_len:  # the prefill node frees, the router retries
            self._refuse(rid, f"decode queue full ({self.max_queue_len} waiting for KV)", retryable=True)
            return
        try:
            params = SamplingParams.from_dict(ready.sampling)
            request = Request(rid, list(ready.prompt_token_ids), params, priority=ready.priority,
                              num_prior_output_tokens=ready.num_prior_output_tokens)
            _first_tokens(request, ready, self.engine.config.max_num_seqs)
            request.timings["kv_ready_received"] = time.time()
            request.kv_lease_renewed_at = time.monotonic()  # the lease was just granted
            # Cached blocks stand in for the transfer's first blocks only where the blocks are alike.
            request.kv_reuse_prefix = ready.block_size == self.engine.block_manager.block_size
            self.scheduler.add_remote(request)  # refuses an id held already
        except ValueError as e:
            self._refuse(rid, str(e))
            return
        self.requests.admit(rid, Stage.WAITING_FOR_KV, kv_ready=ready)

    def _refuse(self, request_id: str, error: str, *, retryable: bool = False) -> None:
        """Not taken: the prefill node frees its blocks (KVDone), the router hears why."""
        self.receiver.release(request_id, error=error)
        self.link.send(Error(request_id=request_id, node_id=self.node_id, message=error, retryable=retryable))
        self.requests.forget_unadmitted(request_id)

    def _start_pulls(self) -> None:
        """Pull the KV of every request the scheduler found blocks for; renew the leases of those
        still waiting (back-pressure: the prefill node keeps their blocks pinned meanwhile)."""
        arrived_before = self.faults.pull_arrived_before(time.monotonic()) if self.faults is not None else None
        for request in self.scheduler.schedule_remote_kv(arrived_before=arrived_before):
            self.requests.move(request.request_id, Stage.RECEIVING_KV)
            bm = self.engine.block_manager  # the blocks its prefix cache held are not pulled again
            self.receiver.pull(request.request_id, list(bm.block_ids(request.request_id)),
                               first_block=request.num_cached_tokens // bm.block_size)
        now = time.monotonic()
        for request in self.scheduler.waiting_for_kv:
            if now - request.kv_lease_renewed_at > LEASE_RENEW_S:
                request.kv_lease_renewed_at = now
                self.receiver.renew(request.request_id)

    @property
    def num_kv_bytes_received(self) -> int:
        """KV bytes copied into this pool, every rank's, by every transport (the receiver counts them)."""
        return self.receiver.num_bytes_received

    def _transfer_done(self, request: Request, num_bytes: int) -> None:
        if request.kv_pull_started_at is not None:
            self.metrics.observe_transfer(num_bytes, time.monotonic() - request.kv_pull_started_at)

    # ---- decode -----------------------------------------------------------------------------
    def _step(self) -> None:
        if self.faults is not None:
            self.faults.delay_step()
        stepped = self.steps.step(self.engine)
        # decodes' tokens (several a step when speculating); local prefills' first tokens
        tokens, finished, first_tokens = self.local.sort_step(stepped)
        for rid, requests in first_tokens.items():
            self.local.first_tokens(rid, requests)
        if tokens:
            self.link.send(TokenBatch.from_tokens(self.node_id, tokens))
        for rid in finished:  # once its last token is on its way to its router
            self.requests.forget(rid)

    # ---- reporting --------------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat:
        sched, bm = self.scheduler, self.engine.block_manager
        return Heartbeat(
            node_id=self.node_id, num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting) + sched.num_waiting_for_kv,
            num_outstanding_tokens=outstanding_prompt_tokens(self.engine),  # local prefill still to do
            ready=self.ready, request_ids=self.requests.held_ids(),  # remote-KV states included
            role=self.role,
        )

    def status(self) -> dict:
        sched, bm = self.scheduler, self.engine.block_manager
        return {
            "node_id": self.node_id, "role": self.role, "num_total_blocks": bm.num_blocks,
            "num_used_blocks": bm.num_used_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "num_waiting_for_kv": sched.num_waiting_for_kv, "num_receiving": sched.num_receiving_kv,
            "num_preemptions": sched.num_preemptions, "timings": list(self.requests.recent),
            "pid": os.getpid(),
        }

    def metrics_snapshot(self) -> NodeSnapshot:
        """Called from the status thread at scrape time: reads counters, changes nothing."""
        by_rank = getattr(self.receiver, "num_bytes_by_rank", None)  # test doubles may not count by rank
        return engine_snapshot(self.engine, num_bytes_received=self.num_kv_bytes_received,
                               num_outstanding_prompt_tokens=outstanding_prompt_tokens(self.engine),
                               num_shm_transfers=self.receiver.num_shm_copies,
                               num_zmq_transfers=self.receiver.num_zmq_pulls,
                               auth_refusals=self.receiver.auth_refusals,
                               bytes_received_by_rank=list(by_rank) if by_rank is not None else None)


def _first_tokens(request: Request, ready: KVReady, max_num_seqs: int) -> None:
    """The prefill node's first token; for n > 1, each choice's, kept until the fork."""
    n = request.params.n
    if n == 1:
        request.append_output(ready.first_token, ready.first_logprobs)
        return
    if n > max_num_seqs:
        raise ValueError(f"n={n} exceeds this decode node's max_num_seqs={max_num_seqs}")
    logprobs = ready.choice_first_logprobs or [None] * n
    if len(ready.choice_first_tokens) != n or len(logprobs) != n:
        raise ValueError(f"KVReady for n={n} carries {len(ready.choice_first_tokens)} first tokens")
    request.choice_first_tokens = list(zip(ready.choice_first_tokens, logprobs))
