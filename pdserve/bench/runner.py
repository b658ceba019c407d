"""Release the requests at their arrival offsets, at most `max_concurrency` in flight, and collect
the records.

Every request is a task that sleeps until its arrival, then waits for a concurrency slot (so under a
cap, late arrivals queue on the client as they would in front of a real server), then streams.
Records land in the caller's `BenchmarkRun` as they finish, so when Ctrl-C cancels the run (asyncio
turns SIGINT into a cancellation and then a KeyboardInterrupt) the caller still holds every request
that completed and can summarize them. In-flight requests at that moment are dropped, not failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.chaos import ChaosConfig, ChaosLog, base_url_of, router_retries, run_chaos
from pdserve.bench.client import EndpointConfig, send_request
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.request_record import RequestRecord


@dataclass
class LoadConfig:
    request_rate: float = math.inf  # requests per second; inf sends all at once
    burstiness: float = 1.0  # gamma shape of the arrival gaps; 1 = Poisson
    max_concurrency: int | None = None  # None: no cap
    num_warmups: int = 0  # requests sent and discarded before the timed run
    seed: int = 0  # of the arrival times
    disable_tqdm: bool = False
    request_timeout_s: float | None = 6 * 3600.0
    chaos: ChaosConfig | None = None  # kill or stall nodes during the run (chaos.py)
    offsets: list[float] | None = None  # explicit arrival offsets (a trace), one per request; rate is then a label
    # What the warm-ups send (cycled); None: the run's own requests. The prefix-cache workloads warm up
    # with unrelated prompts, so that the warm-ups do not fill the cache the run measures.
    warmup_samples: list[SampleRequest] | None = None
    # Called (in a thread) after the warm-ups, just before the timed run; what it returns becomes
    # `run.fleet[0]` (the prefix-cache workloads read the fleet's KV counters there: fleet_probe.py).
    probe: Callable[[], object] | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


@dataclass
class BenchmarkRun:
    """Filled while the benchmark runs; readable at any point (that is what Ctrl-C relies on)."""

    request_rate: float = math.inf
    records: list[RequestRecord] = field(default_factory=list)
    start: float | None = None  # perf_counter when the timed run began
    end: float | None = None
    interrupted: bool = False
    chaos: ChaosLog | None = None
    fleet: tuple | None = None  # (before, after) FleetSnapshot for the prefix-cache workloads (fleet_probe.py)

    @property
    def duration_s(self) -> float:
        if self.start is None:
            return 0.0
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    def mark_interrupted(self) -> None:
        self.interrupted = True
        if self.end is None:
            self.end = time.perf_counter()


def _slot(sem: asyncio.Semaphore | None):
    return sem if sem is not None else contextlib.nullcontext()


async def warm_up(session, cfg: EndpointConfig, samples: list[SampleRequest], load: LoadConfig,
                  sem: asyncio.Semaphore | None) -> list[RequestRecord]:
    async def one(i: int) -> RequestRecord:
        async with _slot(sem):
            return await send_request(session, cfg, samples[i % len(samples)], -1 - i)

    return list(await asyncio.gather(*(one(i) for i in range(load.num_warmups))))


async def probe_before(load: LoadConfig, run: BenchmarkRun) -> None:
    if load.probe is not None:
        run.fleet = (await asyncio.to_thread(load.probe), None)


async def run_benchmark(cfg: EndpointConfig, samples: list[SampleRequest], load: LoadConfig,
                        run: BenchmarkRun) -> BenchmarkRun:
    if not samples:
        raise ValueError("no requests to send")
    run.request_rate = load.request_rate
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=load.request_timeout_s)
    # limit=0: the connection pool must not be a hidden concurrency cap of its own (aiohttp's is 100).
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = await warm_up(session, cfg, load.warmup_samples or samples, load, sem)
        if any(not r.success for r in warm):
            print(f"warning: {sum(not r.success for r in warm)} of {len(warm)} warm-up requests failed: "
                  f"{next(r.error for r in warm if not r.success)}")
        if load.offsets is not None:
            if len(load.offsets) != len(samples):
                raise ValueError(f"{len(load.offsets)} arrival offsets for {len(samples)} requests")
            offsets = list(load.offsets)
        else:
            offsets = arrival_offsets(len(samples), load.request_rate, load.burstiness, load.seed)
        await probe_before(load, run)
        bar = tqdm(total=len(samples), disable=load.disable_tqdm, desc=f"rate {load.request_rate:g}")
        run.start = time.perf_counter()

        async def one(i: int, offset: float) -> None:
            await asyncio.sleep(max(0.0, run.start + offset - time.perf_counter()))
            async with _slot(sem):
                record = await send_request(session, cfg, samples[i], i, clock_zero=run.start)
            run.records.append(record)
            bar.update(1)

        chaos = None
        if load.chaos is not None:
            run.chaos = ChaosLog(retries_before=await router_retries(session, base_url_of(cfg.api_url)))
            chaos = asyncio.create_task(run_chaos(session, base_url_of(cfg.api_url), load.chaos, run.chaos,
                                                  run.start))
        try:
            await asyncio.gather(*(one(i, off) for i, off in enumerate(offsets)))
            run.end = time.perf_counter()
        finally:
            bar.close()
            if chaos is not None:
                chaos.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await chaos
        if run.chaos is not None:
            run.chaos.retries_after = await router_retries(session, base_url_of(cfg.api_url))
    return run
