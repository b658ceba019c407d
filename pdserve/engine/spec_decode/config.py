"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's keys, validated (pure Python).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    {"model": "/path/to/draft", "num_speculative_tokens": 4}     (method "draft_model" implied)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int  # k: draft tokens proposed (and verified) per decode step
    method: str | None = None  # "ngram" or "draft_model"; None: "draft_model" with a model, else "ngram"
    model: str | None = None  # draft model (a folder or an alias resolve_model knows); shares the tokenizer
    prompt_lookup_max: int | None = None  # ngram: longest suffix looked up (default 3)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix looked up (default 1)

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config: method draft_model needs \"model\": a draft model path")
            if self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
                raise ValueError("speculative_config: prompt_lookup_max/min apply to method ngram only")
            return
        if self.model is not None:
            raise ValueError("speculative_config: method ngram takes no \"model\"")
        self.prompt_lookup_min = 1 if self.prompt_lookup_min is None else self.prompt_lookup_min
        self.prompt_lookup_max = max(3, self.prompt_lookup_min) if self.prompt_lookup_max is None \
            else self.prompt_lookup_max
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a config, a dict of vLLM's keys, or their JSON text; None (or "") stays None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        return cls(**value)

    def to_json(self) -> str:
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
