"""transformers' static batching as the floor of a serving comparison, measured into `RequestRecord`s.

The prompts all "arrive" at once (request rate inf) and run in fixed batches, one after another,
through `benchmarks.offline._hf_batch` (left padding; min = max new tokens, so EOS is ignored). A
streamer stamps the time each decoding step's tokens reach the host; a request's TTFT is its batch's
first step (measured from the start of the whole run, so waiting for earlier batches counts, as it
does on a server), its ITLs are the step gaps, its E2E the step of its own last token. These are the
same definitions the HTTP client uses, so the rows of one table compare.
"""

from __future__ import annotations

import time

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.request_record import RequestRecord
from pdserve.bench.runner import BenchmarkRun


class StepClock:
    """A transformers streamer (the `put`/`end` interface) that keeps only arrival times. The first
    `put` is the prompt; each later one is a decoding step's tokens for the whole batch."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TimedModel:
    """What `_hf_batch` needs of a model (`device`, `generate`), with a StepClock on every generate."""

    def __init__(self, model) -> None:
        self.model = model
        self.clock = StepClock()

    @property
    def device(self):
        return self.model.device

    def generate(self, *args, **kwargs):
        self.clock = StepClock()
        return self.model.generate(*args, streamer=self.clock, **kwargs)


def batch_records(clock: StepClock, batch: list[tuple[int, SampleRequest]], t0: float) -> list[RequestRecord]:
    steps = clock.times[1:]  # drop the prompt's put
    out = []
    for request_id, sample in batch:
        mine = steps[: sample.output_len]
        out.append(RequestRecord(request_id, sample.prompt_len, sample.output_len, success=True, start_s=0.0,
                                 ttft_s=mine[0] - t0, itl_s=[b - a for a, b in zip(mine, mine[1:])],
                                 e2el_s=mine[-1] - t0, output_len=len(mine)))
    return out


def run_static_batches(model, samples: list[SampleRequest], batch_size: int, pad_token_id: int,
                       sync=lambda: None) -> BenchmarkRun:
    """Every sample (token-id prompts) in batches of `batch_size`; `sync` waits for the device."""
    from benchmarks.offline import _hf_batch

    timed = TimedModel(model)
    _hf_batch(timed, [samples[0].prompt[:8]], 2, pad_token_id)  # warm-up
    run = BenchmarkRun(start=time.perf_counter())
    for i in range(0, len(samples), batch_size):
        batch = list(enumerate(samples))[i: i + batch_size]
        _hf_batch(timed, [s.prompt for _, s in batch], max(s.output_len for _, s in batch), pad_token_id)
        sync()
        run.records += batch_records(timed.clock, batch, run.start)
    run.end = time.perf_counter()
    return run
