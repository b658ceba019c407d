"""One request's life inside the router: its state, its timing, and the re-sequencing of its tokens.

The states a request passes through (`RouterRequestStatus`):

    WAITING      validated and tokenized; no node chosen yet
    PREFILLING   PrefillRequest sent to the prefill node; waiting for output index 0
    DECODING     the first token was delivered; the rest stream in from the decode node
                 (or from the same node, when it is a colocated "both" node)
    FINISHED     a node set finish_reason on the last token, or the router found a stop string
                 in the text (the router then sends Abort to every node holding the request)
    ABORTED      the client went away (Abort sent to the nodes)
    FAILED       a node reported an error, a node died, or the deadline passed (Abort sent to
                 the nodes still alive); the client gets an error body or an error event

Tokens carry their output index. The first token comes from the prefill node and the others
from the decode node, on different sockets, so they may arrive in any order: each is buffered
until every token before it is in, then fed to the detokenizer in order. A token at or past an
index already delivered, or past max_tokens, is a duplicate or a bug and is dropped.
`receive_batch` takes a whole TokenBatch (one token per request, usually: the next one, which
skips the buffer) and detokenizes it in rounds of one token per request, so a stop string ends
a request at the token that completed it, exactly as token-by-token delivery would.

The HTTP side reads a request's output from its outbox: the router `push`es one delta per
request per batch, and the handler (`ChoiceGroup.wait_deltas`, choices.py) takes everything pushed since it last ran;
a non-streamed request's handler is only woken at the end.

Attempts. When a node holding the request dies (or a KV transfer fails) the router re-dispatches
it: attempt k+1 is a new request on the nodes, with its own wire id (`wire_id`), whose prompt is
the original prompt plus every token delivered so far and whose max_tokens is what is left. Its
output index 0 is the request's index `index_offset`; tokens of earlier attempts carry a wire id
the router no longer knows, so a late one from a dying node cannot slip into the stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.detokenizer import IncrementalDetokenizer, add_tokens_batch
from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import Token

_NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; vLLM sends this value too


class RouterRequestStatus(enum.Enum):
    """Where a request is as the router sees it (the table above); not the engine's RequestStatus
    (engine/request.py), which tracks one attempt's sequence inside a node."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    ABORTED = "aborted"
    FAILED = "failed"

    is_done: bool  # set on each member below: a plain attribute, read for every token


for _status in RouterRequestStatus:
    _status.is_done = _status.name in ("FINISHED", "ABORTED", "FAILED")


@dataclass
class RequestTiming:
    """Monotonic timestamps (seconds) for the metrics; `arrival_wall` is time.time() for the wire."""

    arrival_wall: float = field(default_factory=time.time)
    arrival: float = field(default_factory=time.monotonic)
    dispatched: float | None = None
    first_token: float | None = None  # index 0 delivered in order
    token_times: list[float] = field(default_factory=list)  # when output token i was delivered in order
    finished: float | None = None
    prefill_queued_s: float = 0.0  # reported by the prefill node with the first token
    prefill_s: float = 0.0
    num_cached_tokens: int = 0


@dataclass
class TokenLogprob:
    token_id: int
    token: str  # the token decoded alone
    logprob: float
    top: list[tuple[str, float]]  # (token text, logprob), most likely first; the node's whole map
    text_offset: int  # characters of output before this token (sum of earlier tokens' text)


@dataclass
class RouterError:
    message: str
    status: int  # the HTTP status when nothing was streamed yet
    type: str  # the OpenAI error type


@dataclass(slots=True)
class Delta:
    """What one event adds to a request's output; the HTTP side turns it into a chunk."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when asked, else empty
    finish_reason: str | None = None
    error: RouterError | None = None


class RouterRequest:
    def __init__(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams, tokenizer,
                 *, deadline: float | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling = sampling
        self.tokenizer = tokenizer
        self.deadline = deadline  # monotonic; None = none
        self.status = RouterRequestStatus.WAITING
        self.prefill_node_id = ""
        self.decode_node_id = ""  # "" when the prefill node decodes it too
        self.timing = RequestTiming()
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, sampling.stop)
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.stopped_by_router = False  # a stop string ended it while the nodes were still generating
        self.outbox: list[Delta] = []  # deltas not yet taken by the HTTP side (take_deltas)
        self.wake_each_delta = True  # False (not streamed): the HTTP side is woken at the end only
        self.waiter: asyncio.Future | None = None  # the HTTP side's wait (`ChoiceGroup.wait_deltas` sets it)
        self._pending: dict[int, Token] = {}  # out-of-order tokens, by output index
        self._num_logprob_chars = 0
        self.attempt = 0  # re-dispatches so far
        self.index_offset = 0  # output tokens delivered before the current attempt started
        self.last_listed = time.monotonic()  # a node's heartbeat last listed the current attempt
        # What the current attempt sends the nodes: the prompt plus the tokens delivered before
        # it, and the sampling parameters with the tokens left to generate.
        self.attempt_prompt_ids, self.attempt_sampling = self.prompt_token_ids, sampling

    @property
    def wire_id(self) -> str:
        """The id the nodes know the current attempt by."""
        return self.request_id if self.attempt == 0 else f"{self.request_id}~{self.attempt}"

    @property
    def attempt_started(self) -> bool:
        """The current attempt's first token has been delivered (its prefill is over)."""
        return len(self.output_token_ids) > self.index_offset

    def next_attempt(self) -> None:
        """Start a new attempt, continuing from the tokens delivered so far."""
        self.attempt += 1
        self.index_offset = len(self.output_token_ids)
        self._pending.clear()  # the old attempt's out-of-order tokens; the new one resends them
        self.prefill_node_id = self.decode_node_id = ""
        self.last_listed = time.monotonic()
        self.attempt_prompt_ids = self.prompt_token_ids + self.output_token_ids
        left = self.sampling.max_tokens - self.index_offset
        self.attempt_sampling = dataclasses.replace(self.sampling, max_tokens=left)

    @property
    def node_ids(self) -> list[str]:
        """Every node that may hold state for the request."""
        return [n for n in dict.fromkeys((self.prefill_node_id, self.decode_node_id)) if n]

    def mark_dispatched(self, prefill_node_id: str, decode_node_id: str) -> None:
        self.prefill_node_id, self.decode_node_id = prefill_node_id, decode_node_id
        if self.status == RouterRequestStatus.WAITING:
            self.status = RouterRequestStatus.PREFILLING
        if self.timing.dispatched is None:  # the first attempt's, for the TTFT split
            self.timing.dispatched = time.monotonic()

    def receive(self, token: Token) -> Delta | None:
        """Buffer one token of the current attempt; returns what became deliverable in order
        (None when nothing did). One token alone; `receive_batch` takes a step's worth."""
        return receive_batch([(self, token)]).get(self)

    def _buffer(self, token: Token) -> bool:
        """Keep `token` until every token before it is in; False when it is dropped (a
        duplicate, out of range, or the request ended)."""
        at = token.index + self.index_offset  # the token's index in the whole output
        if (self.status.is_done or token.index < 0 or at < len(self.output_token_ids)
                or at >= self.sampling.max_tokens or at in self._pending):
            return False
        self._pending[at] = token
        return True

    def _take_in_order(self) -> list[Token]:
        """The buffered tokens that follow the output without a gap, removed from the buffer."""
        out, index = [], len(self.output_token_ids)
        while index in self._pending:
            out.append(self._pending.pop(index))
            index += 1
        return out

    def _accept(self, token: Token, piece: str, delta: Delta, now: float) -> None:
        """`token` is the next output token and `piece` the text the detokenizer let out for it."""
        final = token.finish_reason is not None
        if not self.output_token_ids:
            self.timing.first_token = now
            self.status = RouterRequestStatus.DECODING
        self.output_token_ids.append(token.token_id)
        self.timing.token_times.append(now)
        delta.token_ids.append(token.token_id)
        delta.text += piece
        if self.sampling.logprobs is not None:
            delta.logprobs.append(self._logprob(token))
        if self.detokenizer.stopped:
            self.stopped_by_router = not final
            self._finish(delta, "stop")
        elif final:
            self._finish(delta, token.finish_reason)

    def _finish(self, delta: Delta, reason: str) -> None:
        self.status, self.finish_reason, delta.finish_reason = RouterRequestStatus.FINISHED, reason, reason
        self.timing.finished = time.monotonic()

    def _logprob(self, token: Token) -> TokenLogprob:
        entries = {int(k): float(v) for k, v in (token.logprobs or {}).items()}
        text = self._decode_one(token.token_id)
        top = sorted(entries.items(), key=lambda kv: -kv[1])
        entry = TokenLogprob(token.token_id, text, max(entries.get(token.token_id, _NEG_INF_LOGPROB), _NEG_INF_LOGPROB),
                             [(self._decode_one(t), max(lp, _NEG_INF_LOGPROB)) for t, lp in top],
                             self._num_logprob_chars)
        self._num_logprob_chars += len(text)
        return entry

    def _decode_one(self, token_id: int) -> str:
        return self.detokenizer.decoder.decode_one(token_id)

    # ---- the HTTP side's end of the request ---------------------------------------------------
    def push(self, delta: Delta) -> None:
        """Hand `delta` to the HTTP side, waking it (a non-streamed request: at the end only)."""
        self.outbox.append(delta)
        waiter = self.waiter
        if waiter is not None and not waiter.done() and (self.wake_each_delta or self.status.is_done):
            waiter.set_result(None)

    def take_deltas(self) -> list[Delta]:
        out, self.outbox = self.outbox, []
        return out

    def ready(self) -> bool:
        """The outbox holds what the HTTP side should take now."""
        return bool(self.outbox) and (self.wake_each_delta or self.status.is_done)

    def interrupt(self, error: BaseException) -> None:
        """Raise `error` in the HTTP side's wait (`ChoiceGroup.wait_deltas`; its client went away)."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    def fail(self, error: RouterError) -> Delta | None:
        """End the request with an error; None if it already ended."""
        if self.status.is_done:
            return None
        self.status = RouterRequestStatus.FAILED
        self.timing.finished = time.monotonic()
        return Delta(error=error)

    def abort(self) -> bool:
        """The client is gone; False if the request had already ended."""
        if self.status.is_done:
            return False
        self.status = RouterRequestStatus.ABORTED
        self.timing.finished = time.monotonic()
        return True


_UNSEEN: list = []  # receive_batch: no token of the request yet


def receive_batch(arrivals: list[tuple[RouterRequest, Token]]) -> dict[RouterRequest, Delta]:
    """A step's tokens, each for its request: buffer them, then deliver what is in order, one token
    per request per round (`add_tokens_batch`), so a stop string ends a request at the very token
    that completed it, as if the tokens had come one by one. Returns each request's delta, for
    those whose output grew."""
    order: dict[RouterRequest, list[Token] | None] = {}  # None: take what is in order from the buffer
    for req, token in arrivals:
        seen = order.get(req, _UNSEEN)
        if (seen is _UNSEEN and not req._pending and not req.status.is_done and token.index >= 0
                and token.index + req.index_offset == len(req.output_token_ids) < req.sampling.max_tokens):
            order[req] = [token]  # the usual case: the next token, nothing buffered
            continue
        if seen is not _UNSEEN and seen is not None:  # a second token: the first goes to the buffer too
            req._pending[len(req.output_token_ids)] = seen[0]
        if req._buffer(token) or seen is not _UNSEEN:
            order[req] = None
    for req, tokens in order.items():
        if tokens is None:
            order[req] = req._take_in_order()
    deltas: dict[RouterRequest, Delta] = {}
    now = time.monotonic()
    round_ = 0
    while True:
        items = [(req, tokens[round_]) for req, tokens in order.items()
                 if round_ < len(tokens) and not req.status.is_done]
        if not items:
            break
        pieces = add_tokens_batch([(req.detokenizer, token.token_id, token.finish_reason is not None)
                                   for req, token in items])
        for (req, token), piece in zip(items, pieces):
            delta = deltas.get(req)
            if delta is None:
                delta = deltas[req] = Delta()
            req._accept(token, piece, delta, now)
        round_ += 1
    return deltas
