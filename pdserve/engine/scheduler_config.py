"""The scheduler's limits and policy (engine/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.scheduling_policy import (
    DEFAULT_SCHEDULING_POLICY,
    DEFAULT_SJF_AGING_S,
    DEFAULT_SJF_LENGTH_FACTOR,
    SchedulingPolicy,
)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY  # fcfs | priority | sjf (engine/scheduling_policy.py)
    sjf_length_factor: float = DEFAULT_SJF_LENGTH_FACTOR  # sjf: estimate = min(prompt len x factor, max_tokens)
    sjf_aging_s: float = DEFAULT_SJF_AGING_S  # sjf: a request that waited this long is no longer overtaken
    num_lookahead_tokens: int = 0  # speculative decoding: draft slots per decode step (k; 0 = off)

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.scheduling_policy, self.sjf_length_factor, self.sjf_aging_s)
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}), or no long prompt could ever be scheduled"
            )
