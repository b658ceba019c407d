"""A request's state inside one engine (pure Python: no torch).

Lengths, drawn once (vLLM's names):

    |<------------- num_tokens = len(all_token_ids) ------------->|
    |<--------- num_prompt_tokens --------->|<--- output_ids ---->|
    |<----- num_computed_tokens ----->|<-- num_new_tokens -->|
                                      (scheduled this step; their KV is written this step)

A running request in decode has num_computed_tokens == num_tokens - 1: the last sampled token
is fed back in the next step. Preemption by recompute resets num_computed_tokens to 0 and the
whole sequence (prompt + outputs so far) is prefilled again.

States (`RequestStatus`), per role; the scheduler moves a request between them:

    any engine:   WAITING ─▶ RUNNING ─▶ FINISHED_*          (preempted: ─▶ WAITING or SWAPPED ─▶ RUNNING)
    prefill node: RUNNING ─▶ TRANSFERRING                  (detached: blocks pinned under a lease)
    decode node:  WAITING_FOR_KV ─▶ RECEIVING_KV ─▶ RUNNING ─▶ FINISHED_*
                  (KV announced,    (blocks here,    (prompt KV computed elsewhere)
                   no blocks)        copy in flight)

Parallel sampling (n > 1). A *parent* request (params.n > 1) is prefilled once; the step that
samples its first tokens draws one per choice from the same logits and forks it into n *children*
`{request_id}#{i}` (`child_id`), ordinary n = 1 requests sampling with `params.for_choice(i)`, that
share the parent's blocks by reference count; the parent itself then leaves the scheduler.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks in the device pool
    SWAPPED = "swapped"  # preempted; its KV lives in host blocks
    WAITING_FOR_KV = "waiting_for_kv"  # decode node: KV announced by a prefill node, no blocks yet
    RECEIVING_KV = "receiving_kv"  # decode node: blocks allocated, copy in flight
    TRANSFERRING = "transferring"  # prefill node: out of the scheduler, blocks pinned under a lease
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "abort"  # abort() or client gone

    @property
    def is_finished(self) -> bool:
        return self in FINISHED

    @property
    def is_remote_kv(self) -> bool:
        """Its prompt KV comes from another node and has not arrived yet."""
        return self in (RequestStatus.WAITING_FOR_KV, RequestStatus.RECEIVING_KV)


# The end states (a tuple: `in` compares by identity first; an Enum's hash is Python code).
FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
_arrival_counter = itertools.count()


@dataclass(eq=False, slots=True)  # slots: a step reads every running request's fields (fewer cache lines)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # lower is served first when the scheduler runs by priority
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in this request's blocks
    num_cached_tokens: int = 0  # tokens served from the prefix cache at the last admission
    num_preemptions: int = 0
    # The last n prompt tokens are output of an earlier attempt (a re-dispatch continues a request
    # elsewhere): sampling treats them as output, so seeded draws and penalties carry on unchanged.
    num_prior_output_tokens: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # wall-clock events, for latency breakdowns
    # Remote KV (decode node), monotonic times: the last LeaseRenew sent while it waited for blocks,
    # and when its pull started (RECEIVING_KV), for the transfer-time metric.
    kv_lease_renewed_at: float = 0.0
    kv_pull_started_at: float | None = None
    # Remote KV: the blocks the prefix cache holds may stand in for the first blocks of the transfer
    # (False when the sender's blocks are another size: a pull then moves every token).
    kv_reuse_prefix: bool = True
    # Tie-break for equal arrival times: admission order is stable.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    # Output tokens the last engine step appended: 1, or up to k + 1 with speculative decoding.
    num_new_output_tokens: int = 0
    # Parallel sampling: a child's parent id and choice index; a decode node's parent carries each
    # choice's first token (token id, logprobs), sampled by the prefill node, until it forks.
    parent_id: str | None = None
    choice_index: int = 0
    choice_first_tokens: list[tuple[int, dict[int, float] | None]] = field(default_factory=list)
    # Set from the fields above by __post_init__:
    all_token_ids: list[int] = field(init=False, repr=False)  # prompt, then outputs
    _sampling_prompt: list[int] = field(init=False, repr=False)
    _prior_output: list[int] = field(init=False, repr=False)
    is_plain_greedy: bool = field(init=False, repr=False)
    forks: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if not 0 <= self.num_prior_output_tokens < len(self.prompt_token_ids):
            raise ValueError(f"request {self.request_id}: num_prior_output_tokens must be in "
                             f"[0, {len(self.prompt_token_ids)}), got {self.num_prior_output_tokens}")
        self.all_token_ids = list(self.prompt_token_ids)
        self.all_token_ids.extend(self.output_token_ids)
        k = self.num_prior_output_tokens  # split once: sampling_view runs every step
        self._sampling_prompt = self.prompt_token_ids[:-k] if k else self.prompt_token_ids
        self._prior_output = self.prompt_token_ids[-k:] if k else []
        p = self.params  # read once here: the sampler's fast path asks every step
        # Its next token is the plain argmax: no penalties, logprobs or choices to draw.
        self.is_plain_greedy = p.n == 1 and p.greedy and not p.needs_penalties and p.logprobs is None
        self.forks = p.n > 1  # a parent of n > 1 choices: its next draw forks it into its children

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def sampling_view(self) -> tuple[list[int], list[int]]:
        """(prompt, output) as sampling sees them: prior attempts' tokens count as output."""
        if not self._prior_output:
            return self.prompt_token_ids, self.output_token_ids
        return self._sampling_prompt, self._prior_output + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def drop_last_outputs(self, num: int) -> None:
        """Forget the last `num` output tokens (a stop string ended the request before them)."""
        if num <= 0:
            return
        del self.output_token_ids[-num:]
        del self.all_token_ids[-num:]
        if self.output_logprobs:
            del self.output_logprobs[-num:]
        self.num_new_output_tokens = max(0, self.num_new_output_tokens - num)

    def append_output(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)

    # ---- parallel sampling ----------------------------------------------------------------
    def sampling_rows(self) -> list[tuple[str, SamplingParams]]:
        """(request id, params) of each draw its next logits feed: itself, or its n choices."""
        if not self.forks:
            return [(self.request_id, self.params)]
        return [(child_id(self.request_id, i), self.params.for_choice(i)) for i in range(self.params.n)]

    def fork(self, index: int) -> Request:
        """Choice `index`: the same prompt, KV progress, order and timings; its own params. The
        caller gives it blocks (`BlockManager.fork`) and its first token."""
        return Request(
            child_id(self.request_id, index), self.prompt_token_ids, self.params.for_choice(index),
            priority=self.priority, arrival_time=self.arrival_time, status=self.status,
            num_computed_tokens=self.num_computed_tokens, num_cached_tokens=self.num_cached_tokens,
            num_preemptions=self.num_preemptions, num_prior_output_tokens=self.num_prior_output_tokens,
            timings=dict(self.timings), arrival_seq=self.arrival_seq, parent_id=self.request_id,
            choice_index=index,
        )


def child_id(request_id: str, index: int) -> str:
    """The id choice `index` of an n > 1 request runs under (the nodes stream tokens with it)."""
    return f"{request_id}#{index}"
