"""The order in which waiting requests are admitted (pure Python: no torch).

    fcfs      arrival order (vLLM's default).
    priority  (priority, arrival): lower first, arrival breaks ties.
    sjf       shortest job first: (effective estimate, arrival), with the estimate aged.

Under fcfs and sjf a request's priority must be 0 (vLLM refuses it too): it would be ignored.

Shortest job first estimates a request's job length as the reference articles do (§5.2):

    estimate = min(num_prompt_tokens x sjf_length_factor, max_tokens)     output tokens, > 0

and ages it linearly with the time the request has waited on this engine (since its arrival):

    effective = estimate x max(0, 1 - waited / sjf_aging_s)

The aging bound: once a request has waited `sjf_aging_s` its effective estimate is 0, below that of
every request that has waited less (whose estimates are still > 0), and requests at 0 keep their
arrival order. So a request that has waited `sjf_aging_s` is never overtaken by a later arrival:
from then on it is admitted exactly as first come, first served would admit it, at the first step
that has a seat (`max_num_seqs`) and blocks for it after the older aged requests. `sjf_aging_s =
inf` turns aging off (long requests can then wait for ever under a stream of short ones).

Only the waiting queues are ordered (waiting, swapped, a decode node's waiting-for-KV); running
requests are never reordered, and preemption keeps its order (the latest arrival is the victim).
Swapped requests, admitted once already, come back before any waiting one under every policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority", "sjf")
DEFAULT_SCHEDULING_POLICY = "fcfs"
# The article gives the form of the estimate but no factor: 1.0 reads "an answer about as long as
# its question", and leaves max_tokens the estimate whenever it is the smaller.
DEFAULT_SJF_LENGTH_FACTOR = 1.0
DEFAULT_SJF_AGING_S = 30.0


def check_scheduling_values(policy: str, length_factor: float, aging_s: float) -> None:
    """ValueError (one line, naming the setting) for a value no scheduler could use."""
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
    if not _is_number(length_factor) or not 0 < length_factor < math.inf:
        raise ValueError(f"sjf_length_factor must be a finite number > 0, got {length_factor!r}")
    if not _is_number(aging_s) or not aging_s > 0:
        raise ValueError(f"sjf_aging_s must be a number > 0 (inf: no aging), got {aging_s!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


@dataclass(frozen=True)
class SchedulingPolicy:
    name: str = DEFAULT_SCHEDULING_POLICY
    sjf_length_factor: float = DEFAULT_SJF_LENGTH_FACTOR
    sjf_aging_s: float = DEFAULT_SJF_AGING_S

    def __post_init__(self) -> None:
        check_scheduling_values(self.name, self.sjf_length_factor, self.sjf_aging_s)

    @property
    def is_time_dependent(self) -> bool:
        """The order changes as requests wait: the queues are sorted again before each admission."""
        return self.name == "sjf"

    def check_priority(self, request: Request) -> None:
        if request.priority != 0 and self.name != "priority":
            raise ValueError(f"request {request.request_id}: priority={request.priority} needs "
                             f"scheduling_policy='priority' (this engine runs {self.name!r})")

    def estimated_len(self, request: Request) -> float:
        """The job length the article estimates: min(input_len x factor, max_tokens) output tokens."""
        return min(request.num_prompt_tokens * self.sjf_length_factor, request.params.max_tokens)

    def effective_len(self, request: Request, now: float) -> float:
        """The estimate shrunk by aging: 0 once the request has waited `sjf_aging_s` seconds."""
        waited = max(0.0, now - request.arrival_time)
        return self.estimated_len(request) * max(0.0, 1.0 - waited / self.sjf_aging_s)

    def sjf_key(self, request: Request, now: float) -> tuple[float, int]:
        """Shortest job first's order at monotonic time `now`: smaller is admitted first."""
        return (self.effective_len(request, now), request.arrival_seq)

    def sort(self, queue: list[Request], now: float) -> None:
        """Re-sort a waiting queue in place when its order depends on the time (sjf). The scheduler
        keeps the queues sorted by (priority, arrival) as requests come in, which is fcfs's order
        too, since fcfs refuses any priority but 0 (`check_priority`)."""
        if self.is_time_dependent and len(queue) > 1:
            queue.sort(key=lambda r: self.sjf_key(r, now))
