"""Engine step samples for the heartbeats (`Heartbeat.step_samples`): per step
`[prefill tokens, decode sequences, context tokens of those sequences, wall seconds]`, from
which the router's planner fits the node's speed.

`StepSamples.step(engine)` runs one `engine.step_requests()` and records its row, read from the
engine's own state without changing it:

    prefill tokens      prompt positions the step computed (the scheduler's
                        `num_prompt_tokens_computed` before and after: prefix-cache hits are not
                        computed, so not counted)
    decode sequences    requests the step gave a token that already had one (a decode, not a
                        prompt's first token; a decode node's remote-KV request has the prefill
                        node's first token)
    context tokens      for each of those, the tokens its step attended to (its tokens before the
                        step's new ones)
    seconds             the step's wall time

The node loop records; each router's heartbeat thread takes the rows recorded since its own last
heartbeat (`since`), newest last, at most MAX_STEP_SAMPLES, so every router sees the same window.
A lock guards the deque: the loop appends, the heartbeat threads read.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

from pdserve.protocol.messages import MAX_STEP_SAMPLES


class StepSamples:
    def __init__(self, maxlen: int = MAX_STEP_SAMPLES) -> None:
        self._rows: deque[tuple[int, list[float]]] = deque(maxlen=maxlen)  # (sequence number, row)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self.num_recorded = 0

    def step(self, engine) -> list:
        """One engine step (`engine.step_requests()`), its row recorded; returns its requests."""
        sched = engine.scheduler
        prompt_before = sched.num_prompt_tokens_computed
        start = time.perf_counter()
        stepped = engine.step_requests()
        seconds = time.perf_counter() - start
        decodes = [r for r in stepped if r.num_output_tokens > max(1, r.num_new_output_tokens)]
        context = sum(r.num_tokens - max(1, r.num_new_output_tokens) for r in decodes)
        self.record(sched.num_prompt_tokens_computed - prompt_before, len(decodes), context, seconds)
        return stepped

    def record(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, seconds: float) -> None:
        with self._lock:
            self._rows.append((next(self._seq), [float(prefill_tokens), float(decode_seqs), float(context_tokens),
                                                 float(seconds)]))
            self.num_recorded += 1

    def since(self, seq: int) -> tuple[list[list[float]], int]:
        """The rows recorded after sequence number `seq` (those still kept), newest last, and the
        sequence number to ask from next time."""
        with self._lock:
            rows = [row for n, row in self._rows if n > seq]
            last = self._rows[-1][0] if self._rows else seq
        return rows, max(seq, last)
