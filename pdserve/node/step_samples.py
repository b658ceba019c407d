"""Engine step samples for the heartbeats (`Heartbeat.step_samples`): per step
`[prefill tokens, decode sequences, context tokens of those sequences, wall seconds]`, from
which the router's planner fits the node's speed.

`StepSamples.step(engine)` runs one `engine.step_requests()` and records its row, read from
what the engine kept of the step (`engine.last_output`, `engine.timings`) without changing it:

    prefill tokens      prompt positions the step computed (the scheduler's
                        `num_prompt_tokens_computed` before and after: prefix-cache hits are not
                        computed, so not counted)
    decode sequences    requests the step decoded: its chunk starts past the prompt (a decode
                        step's columns, or the chunks of a mixed step)
    context tokens      for each of those, the tokens its step attended to (computed + new)
    seconds             the step's wall time (`engine.timings.total`, measured by the engine)

The node loop records; each router's heartbeat thread takes the rows recorded since its own last
heartbeat (`since`), newest last, at most MAX_STEP_SAMPLES, so every router sees the same window.
A lock guards the deque: the loop appends, the heartbeat threads read.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

from pdserve.protocol.messages import MAX_STEP_SAMPLES


class StepSamples:
    def __init__(self, maxlen: int = MAX_STEP_SAMPLES) -> None:
        self._rows: deque[tuple[int, list[float]]] = deque(maxlen=maxlen)  # (sequence number, row)
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self.num_recorded = 0

    def step(self, engine) -> list:
        """One engine step (`engine.step_requests()`), its row recorded; returns its requests.
        The row comes from what the engine already kept of the step (its schedule and timings):
        a decode step's columns are summed at once, so a batch of 256 costs no per-request loop."""
        sched = engine.scheduler
        prompt_before = sched.num_prompt_tokens_computed
        stepped = engine.step_requests()
        out = engine.last_output
        if out.decode is not None:  # the whole batch decoding one token each: columns
            positions = out.decode.positions
            seqs, context = len(positions), int(positions.sum()) + len(positions)
        else:  # chunks: the decoding ones are those past their prompt
            decodes = [s for s in out.items if s.num_computed_tokens >= s.request.num_prompt_tokens]
            seqs, context = len(decodes), sum(s.num_computed_tokens + s.num_new_tokens for s in decodes)
        self.record(sched.num_prompt_tokens_computed - prompt_before, seqs, context, engine.timings.total)
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
