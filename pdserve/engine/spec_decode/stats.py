"""Acceptance counters of speculative decoding (pure Python; the scheduler updates them in
postprocess, node metrics and the offline engine read them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verification steps that had at least one draft token
    num_draft_tokens: int = 0  # draft tokens verified
    num_accepted_tokens: int = 0  # of which the target kept
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: drafts that had a token at position i
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [i]: of which position i was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` leading tokens of `num_draft_tokens` kept."""
        if num_draft_tokens <= 0:
            return
        grow = num_draft_tokens - len(self.num_draft_tokens_per_pos)
        if grow > 0:
            self.num_draft_tokens_per_pos.extend([0] * grow)
            self.num_accepted_tokens_per_pos.extend([0] * grow)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[i] += 1
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the one the target samples)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.num_draft_tokens_per_pos), list(self.num_accepted_tokens_per_pos))

    def to_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_rate_per_pos": self.acceptance_rate_per_pos()}
