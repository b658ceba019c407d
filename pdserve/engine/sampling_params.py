"""Per-request sampling parameters, validated when built (names and semantics follow vLLM)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16  # output tokens at most (the EOS/stop token counts)
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability sums to >= top_p
    top_k: int = -1  # keep the k most likely tokens; -1 (or 0) = all
    min_p: float = 0.0  # drop tokens whose probability < min_p * max probability
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # HF-style: divides positive / multiplies negative logits of prompt+output tokens
    seed: int | None = None  # the draw at output position i depends only on (seed, i)
    stop: list[str] = field(default_factory=list)  # stop strings; not part of the returned text
    stop_token_ids: list[int] = field(default_factory=list)  # ends the request; kept in token_ids
    ignore_eos: bool = False  # keep going past EOS
    logprobs: int | None = None  # top-n logprobs per output token (plus the sampled token)
    n: int = 1  # output sequences (choices) for the prompt; they share its KV blocks (see for_choice)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(_is_num(self.temperature) and self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        _check(_is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k", "-1, 0 or >= 1", self.top_k)
        _check(_is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_num(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        _check(_is_num(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty", "> 0",
               self.repetition_penalty)
        _check(self.seed is None or _is_int(self.seed), "seed", "an integer or None", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "a list of non-empty strings", self.stop)
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "a list of non-negative integers", self.stop_token_ids)
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "a boolean", self.ignore_eos)
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
               "an integer in [0, 20] or None", self.logprobs)
        _check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters choice `index` of an n > 1 request samples with: n = 1 and, when seeded,
        the derived seed `seed + index` (vLLM's rule), so choice i equals a single request seeded
        with seed + i. Unseeded choices draw independent uniforms from the sampler's generator."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)

    def to_dict(self) -> dict:
        """Plain values only (for the wire)."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        return cls(**values)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check(ok: bool, name: str, expected: str, value) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {expected}, got {value!r}")
