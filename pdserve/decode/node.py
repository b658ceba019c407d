"""The decode node: take KV handed over by prefill nodes, then run continuous decode batching
and stream tokens to the router.

A request's states here:

    KVReady ─▶ WAITING_FOR_KV (no blocks yet; the lease is renewed while it waits)
            ─▶ RECEIVING_KV (blocks allocated here, copy in flight: shared memory or ZMQ frames)
            ─▶ RUNNING in the scheduler (prompt KV computed, first token fed back next step)
            ─▶ finished (EOS, stop token, max_tokens; or Abort from the router)
    A preempted request is recomputed here (its prompt + outputs prefilled again) or swapped.

Ownership: blocks allocated for RECEIVING_KV belong to this node's block manager under the
request id; on a failed transfer or an abort they are freed here and the prefill node is told
(KVDone ok=False) so it frees its own. Once RUNNING, the scheduler owns them.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvtransfer.messages import Abort, Error, Heartbeat, KVReady, Message, TokenBatch
from pdserve.node.messages import token_event
from pdserve.node.metrics import NodeMetrics, NodeSnapshot, engine_snapshot
from pdserve.node.router_link import RouterLink

logger = logging.getLogger(__name__)


class DecodeNode:
    def __init__(self, engine: LLMEngine, link: RouterLink, receiver, *, kv_pull_delay_s: float = 0.0,
                 max_queue_len: int = 1024, step_delay_s: float = 0.0,
                 metrics: NodeMetrics | None = None) -> None:
        self.engine = engine
        self.link = link
        self.receiver = receiver  # KVReceiver
        self.node_id = link.register_msg.node_id
        self.waiting_for_kv: dict[str, Request] = {}  # arrival order
        self.receiving: dict[str, Request] = {}
        self.last_renew: dict[str, float] = {}
        self.kv_pull_delay_s = kv_pull_delay_s  # test knob: simulates a slow network before each pull
        self.timings: deque[dict] = deque(maxlen=1024)
        self.draining = False
        self.step_delay_s = step_delay_s  # test knob: a slower device (sleeps before each engine step)
        self.max_queue_len = max_queue_len  # requests announced, waiting for blocks; past it, refused
        self.pull_started: dict[str, float] = {}  # request id → monotonic time of receiver.pull
        self.num_kv_bytes_received = 0  # by either path (the receiver counts only ZMQ bytes)
        self._kv_bytes_per_token = engine.model_config.kv_elements_per_token * engine.runner.kv_buffer.element_size()
        self.metrics = metrics if metrics is not None else NodeMetrics(self.node_id, "decode")
        self.metrics.watch(self.metrics_snapshot)

    # ---- the loop ---------------------------------------------------------------------------
    def run_once(self) -> None:
        busy = self.engine.has_unfinished() or bool(self.receiving)
        for msg in self.link.poll(0 if busy else 5):
            self.handle(msg)
        for event in self.receiver.poll(0):
            self._on_kv_event(event)
        self._admit_waiting()
        if self.engine.has_unfinished():
            self._step()
        self.link.maybe_heartbeat(self.heartbeat)

    def is_idle(self) -> bool:
        return not (self.engine.has_unfinished() or self.waiting_for_kv or self.receiving)

    def handle(self, msg: Message) -> None:
        if isinstance(msg, Abort):
            self.abort(msg.request_id)
        else:
            logger.warning("decode node: unexpected %s from the router", msg.TYPE)

    def abort(self, request_id: str) -> None:
        self.pull_started.pop(request_id, None)
        if request_id in self.waiting_for_kv or request_id in self.receiving:
            self.last_renew.pop(request_id, None)
            self.waiting_for_kv.pop(request_id, None)
            self.receiving.pop(request_id, None)
            self.engine.block_manager.free(request_id)
            self.receiver.release(request_id, error="aborted")
        else:
            self.engine.abort(request_id)

    # ---- KV arrival -------------------------------------------------------------------------
    def _on_kv_event(self, event) -> None:
        rid = event.request_id
        if event.kind == "ready":
            self._on_ready(event.ready)
        elif event.kind == "done" and rid in self.receiving:
            request = self.receiving.pop(rid)
            request.timings["kv_done"] = time.time()
            self._transfer_done(rid, request.num_prompt_tokens)
            self.timings.append({"request_id": rid, **request.timings})
            self.engine.scheduler.add_prefilled(request)
        elif event.kind == "failed":
            self.pull_started.pop(rid, None)
            self.last_renew.pop(rid, None)
            self.waiting_for_kv.pop(rid, None)
            if self.receiving.pop(rid, None) is not None:
                self.engine.block_manager.free(rid)
            self.link.send(Error(request_id=rid, node_id=self.node_id, message=f"KV transfer failed: {event.error}",
                                 retryable=True))

    def _on_ready(self, ready: KVReady) -> None:
        if len(self.waiting_for_kv) >= self.max_queue_len:  # the prefill node frees, the router retries
            error = f"decode queue full ({self.max_queue_len} waiting for KV)"
            self.receiver.release(ready.request_id, error=error)
            self.link.send(Error(request_id=ready.request_id, node_id=self.node_id, message=error, retryable=True))
            return
        try:
            params = SamplingParams.from_dict(ready.sampling)
            request = Request(ready.request_id, list(ready.prompt_token_ids), params, priority=ready.priority,
                              num_prior_output_tokens=ready.num_prior_output_tokens)
        except ValueError as e:
            self.receiver.release(ready.request_id, error=str(e))
            self.link.send(Error(request_id=ready.request_id, node_id=self.node_id, message=str(e)))
            return
        request.append_output(ready.first_token, ready.first_logprobs)
        request.status = RequestStatus.WAITING_FOR_KV
        request.timings["kv_ready_received"] = time.time()
        self.waiting_for_kv[request.request_id] = request
        self.last_renew[request.request_id] = time.monotonic()

    def _admit_waiting(self) -> None:
        """Allocate blocks for announced KV in arrival order while the pool allows (back-pressure:
        the rest wait, their leases renewed)."""
        bm, sched = self.engine.block_manager, self.engine.scheduler
        pull_before = time.time() - self.kv_pull_delay_s
        for rid, request in list(self.waiting_for_kv.items()):
            room = len(sched.running) + len(self.receiving) < self.engine.config.max_num_seqs
            reserve = bool(sched.running or self.receiving)  # as the scheduler: no watermark on an empty pool
            if not room or not bm.can_allocate(rid, request.num_prompt_tokens, reserve=reserve):
                self._renew_waiting()
                return
            if request.timings["kv_ready_received"] > pull_before:
                return  # the test knob's simulated network delay has not passed yet
            del self.waiting_for_kv[rid]
            self.last_renew.pop(rid, None)
            block_ids = bm.allocate(rid, request.num_prompt_tokens)
            request.status = RequestStatus.RECEIVING_KV
            self.receiving[rid] = request
            self.pull_started[rid] = time.monotonic()
            self.receiver.pull(rid, list(block_ids))

    def _transfer_done(self, request_id: str, num_tokens: int) -> None:
        started = self.pull_started.pop(request_id, None)
        num_bytes = num_tokens * self._kv_bytes_per_token
        self.num_kv_bytes_received += num_bytes
        if started is not None:
            self.metrics.observe_transfer(num_bytes, time.monotonic() - started)

    def _renew_waiting(self) -> None:
        now = time.monotonic()
        for rid in self.waiting_for_kv:
            if now - self.last_renew.get(rid, 0.0) > 5.0:
                self.last_renew[rid] = now
                self.receiver.renew(rid)

    # ---- decode -----------------------------------------------------------------------------
    def _step(self) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        tokens = [token_event(r) for r in self.engine.step_requests()]
        if tokens:
            self.link.send(TokenBatch(node_id=self.node_id, tokens=tokens))

    # ---- reporting --------------------------------------------------------------------------
    def heartbeat(self) -> Heartbeat:
        sched, bm = self.engine.scheduler, self.engine.block_manager
        return Heartbeat(
            node_id=self.node_id, num_free_blocks=bm.num_free_blocks, num_total_blocks=bm.num_blocks,
            num_running=len(sched.running), num_waiting=len(sched.waiting) + len(self.waiting_for_kv),
            ready=not self.draining,
            request_ids=list(sched.requests) + list(self.waiting_for_kv) + list(self.receiving),
        )

    def status(self) -> dict:
        bm = self.engine.block_manager
        return {
            "node_id": self.node_id, "role": "decode", "num_total_blocks": bm.num_blocks,
            "num_used_blocks": bm.num_used_blocks, "num_free_blocks": bm.num_free_blocks,
            "num_running": len(self.engine.scheduler.running), "num_waiting": len(self.engine.scheduler.waiting),
            "num_waiting_for_kv": len(self.waiting_for_kv), "num_receiving": len(self.receiving),
            "num_preemptions": self.engine.scheduler.num_preemptions, "timings": list(self.timings),
            "pid": os.getpid(),
        }

    def metrics_snapshot(self) -> NodeSnapshot:
        """Called from the status thread at scrape time: reads counters, changes nothing."""
        snap = engine_snapshot(self.engine, num_bytes_received=self.num_kv_bytes_received,
                               num_shm_transfers=self.receiver.num_shm_copies,
                               num_zmq_transfers=self.receiver.num_zmq_pulls)
        snap.num_waiting += len(self.waiting_for_kv)  # as the heartbeat counts them
        return snap
