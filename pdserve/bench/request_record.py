"""What one benchmark request measured: the unit every summary, table, JSON file and plot is built from."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """Times are seconds. `start_s` is the send time relative to the benchmark's start (not the
    scheduled arrival: under a concurrency cap a request can wait for a slot first).

        send ──ttft──▶ first token ─itl[0]─▶ chunk 2 ─itl[1]─▶ ... last chunk   [DONE]
        ◀──────────────────────────── e2el_s ──────────────────────────────────▶

    A chunk that brings k tokens adds k samples of its gap / k to `itl_s` (client.py says how k is
    known), so `itl_s` has one entry per output token after the first chunk.
    """

    request_id: int  # index into the dataset's requests
    prompt_len: int  # prompt tokens: the server's usage when reported, else the dataset's count
    max_tokens: int  # the output length asked for
    success: bool = False
    error: str = ""  # why it failed (HTTP status and body, stream error, exception)
    start_s: float = 0.0
    ttft_s: float = 0.0  # send → first chunk carrying output
    itl_s: list[float] = field(default_factory=list)  # per-token gaps after the first chunk
    e2el_s: float = 0.0  # send → end of stream
    output_len: int = 0  # output tokens: usage.completion_tokens, else token ids seen, else chunks
    generated_text: str = ""
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: not reported
    conversation: int | None = None  # conversation workload: the conversation's index
    turn: int | None = None  # conversation workload: the turn's index, 0 first
    # Not written to JSON (they can be long): the exact ids sent and received, for the prefix oracle.
    prompt_ids: list[int] | None = field(default=None, repr=False, compare=False)  # None: a text prompt
    output_ids: list[int] = field(default_factory=list, repr=False, compare=False)  # ids the stream carried

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first; 0 for single-token outputs (as vLLM)."""
        if self.output_len <= 1:
            return 0.0
        return (self.e2el_s - self.ttft_s) / (self.output_len - 1)

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["prompt_ids"], out["output_ids"]
        return {**out, "tpot_s": self.tpot_s}
