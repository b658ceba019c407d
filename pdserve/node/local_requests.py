"""Requests a node prefills AND decodes itself, whatever its role: a colocated node's (`pdserve
prefill --role both`), and a decode node's local prefill (a `PrefillRequest` naming no decode
node). One class, `LocalRequests`, so the two roles share the path instead of copying it:

    PrefillRequest ─admit─▶ PREFILLING (engine.add_request: chunk-prefilled in the running batch,
        │                   under the scheduler's token budget)
        ▼ first token sampled (n > 1: the engine forks; each choice `{id}#{i}` its own entry)
    FirstToken → its router (num_prompt_tokens, num_cached_tokens, queued_s, prefill_s)
        ├─ that ended it ─────────────────────────────────▶ forgotten (the scheduler freed its blocks)
        └─ COLOCATED: decodes here, TokenBatch per step ──▶ finished / aborted ─▶ forgotten

Refusals (an Error to the request's router, nothing held afterwards): the engine's queue full
(`max_queue_len` waiting: retryable, the router sends it elsewhere), a duplicate id or bad
parameters (not retryable). The node keeps its table (`requests`) and engine; this class only
writes the entries of the requests it admits and sends their messages over the node's link.
"""

from __future__ import annotations

import logging
import time

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.engine_wire import token_events
from pdserve.node.requests import NodeRequests, Stage
from pdserve.protocol.messages import Error, FirstToken, PrefillRequest, Token

logger = logging.getLogger(__name__)


class LocalRequests:
    def __init__(self, engine, link, requests: NodeRequests, node_id: str, *, max_queue_len: int = 1024) -> None:
        self.engine = engine
        self.link = link
        self.requests = requests
        self.node_id = node_id
        self.max_queue_len = max_queue_len  # requests waiting to be scheduled; past it, new ones are refused

    # ---- admission --------------------------------------------------------------------------
    def admit(self, msg: PrefillRequest, *, queue_name: str = "prefill") -> bool:
        """Into the engine at PREFILLING (its PrefillRequest kept as the entry's `handoff`); False
        (refused, the router told) when the queue is full, the id is held, or the parameters are bad."""
        rid = msg.request_id
        if len(self.engine.scheduler.waiting) >= self.max_queue_len:  # the router retries it elsewhere
            self.refuse(rid, f"{queue_name} queue full ({self.max_queue_len} waiting)", retryable=True)
            return False
        try:
            if rid in self.requests.held_ids():  # handed off already: out of the engine, still held here
                raise ValueError(f"duplicate request id {rid!r}")
            params = SamplingParams.from_dict(msg.sampling)
            self.engine.add_request(msg.prompt_token_ids, params, request_id=rid, priority=msg.priority,
                                    num_prior_output_tokens=msg.num_prior_output_tokens)
        except ValueError as e:
            self.refuse(rid, str(e))
            return False
        self.requests.admit(rid, Stage.PREFILLING, handoff=msg)
        request = self.engine.scheduler.requests[rid]
        request.timings.update(received=time.time(), router_arrival=msg.arrival_time)
        return True

    def refuse(self, request_id: str, message: str, *, retryable: bool = False) -> None:
        """Not taken: its router hears why; nothing is held for it afterwards."""
        self.link.send(Error(request_id=request_id, node_id=self.node_id, message=message, retryable=retryable))
        self.requests.forget_unadmitted(request_id)

    # ---- one engine step --------------------------------------------------------------------
    def sort_step(self, stepped: list[Request]) -> tuple[list[Token], list[str], dict[str, list[Request]]]:
        """A step's requests: the first tokens just sampled (a PREFILLING request's, or its n > 1
        choices', together under its id), and the tokens of every other (decoding: COLOCATED here,
        or a decode node's DECODING) with those that finished."""
        tokens: list[Token] = []
        finished: list[str] = []
        first_tokens: dict[str, list[Request]] = {}
        stage = self.requests.stage
        for request in stepped:
            rid, parent = request.request_id, request.parent_id
            if stage(rid) is Stage.PREFILLING or (parent is not None and stage(parent) is Stage.PREFILLING):
                first_tokens.setdefault(parent or rid, []).append(request)
                continue
            tokens.extend(token_events(request))  # several a step when speculating
            if request.is_finished:
                finished.append(rid)
        return tokens, finished, first_tokens

    def send_first_tokens(self, rid: str, requests: list[Request]) -> tuple[list[tuple[int, dict | None]], bool]:
        """`rid` sampled its first token (`requests` = [it], or its n > 1 choices): each choice gets
        an entry of its own (PREFILLING, under `rid`), each first token goes to the router.
        Returns each one's (token, logprobs), in choice order (`requests` sorted so), and whether
        the request forked."""
        entry = self.requests.get(rid)
        forked = requests[0].parent_id is not None
        if forked:  # each choice an entry of its own, from the request's router
            requests.sort(key=lambda c: c.choice_index)
            for choice in requests:
                self.requests.admit(choice.request_id, Stage.PREFILLING, parent_id=rid, origin=entry.origin)
        return [(r.output_token_ids[-1], self._send_first_token(r)) for r in requests], forked

    def decode_here(self, rid: str, requests: list[Request], forked: bool) -> None:
        """After their first tokens: those it ended are forgotten, the rest decode here (COLOCATED);
        a forked request's own entry gives way to its choices'."""
        for r in requests:
            if r.is_finished:
                self.requests.forget(r.request_id)
            else:
                self.requests.move(r.request_id, Stage.COLOCATED)
        if forked:
            self.requests.forget(rid)

    def first_tokens(self, rid: str, requests: list[Request]) -> None:
        """The whole local path for a first token: sent, then decoding here (or ended)."""
        _, forked = self.send_first_tokens(rid, requests)
        self.decode_here(rid, requests, forked)

    def _send_first_token(self, request: Request) -> dict | None:
        """FirstToken to the router; returns the token's logprobs."""
        now = time.time()
        t = request.timings
        t["first_token"] = now
        logprobs = request.output_logprobs[-1] if request.output_logprobs else None
        self.link.send(FirstToken(
            request_id=request.request_id, token_id=request.output_token_ids[-1], logprobs=logprobs,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            queued_s=t.get("scheduled", now) - t.get("received", now), prefill_s=now - t.get("scheduled", now),
        ))
        self.requests.log(request.request_id, t)
        return logprobs


def outstanding_prompt_tokens(engine) -> int:
    """Prompt tokens a node still has to compute (queued, or a prompt part-way through its chunks;
    a recomputed preempted request's too). Copies of the lists: the status thread reads this too."""
    sched = engine.scheduler
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in [*sched.waiting, *sched.running])
