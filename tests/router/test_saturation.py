"""Fairness under overload: the router sheds new work with a 429 (Retry-After, OpenAI error body)
when its own event loop or control backlog lags, keeps serving what it accepted, recovers once the
lag is gone, and shows its saturation at /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time

import pytest

from pdserve.router.saturation import (
    CALM_S,
    DECREASE_EVERY_S,
    PROBE_INTERVAL_S,
    SUSTAINED,
    RetryAfter,
    Saturation,
)
from tests.router.conftest import run, serving, split_pair
from tests.router.test_metrics import scrape, value

LIMIT = 0.1


def test_retry_after_is_one_second_without_a_crowd():
    clock = [0.0]
    ra = RetryAfter(clock=lambda: clock[0])
    for _ in range(50):  # busy, admitting 10/s, an occasional 429
        clock[0] += 0.1
        ra.admitted()
    assert ra.rejected() == 1
    clock[0] += 1.0
    ra.admitted()
    assert ra.rejected() == 1


def _storm(retry_after, clients: int = 1000, admit_per_s: int = 20, seconds: int = 60):
    """`clients` all arrive at t=0 and retry after the Retry-After they are told (no jitter); the
    servers take `admit_per_s` per second. Returns (429s per second until every client got in, the
    longest Retry-After told, seconds until every client got in)."""
    clock = [0.0]
    ra = retry_after(lambda: clock[0])
    queue = [(0.0, i) for i in range(clients)]  # (when it retries, client)
    rejected, longest, slots, last_slot_second = 0, 0, 0, -1
    while queue and clock[0] < seconds * 10:
        when, client = heapq.heappop(queue)
        clock[0] = when
        second = int(when)
        if second != last_slot_second:
            slots, last_slot_second = admit_per_s, second
        if slots:
            slots -= 1
            ra.admitted()
        else:
            told = ra.rejected()
            rejected, longest = rejected + 1, max(longest, told)
            heapq.heappush(queue, (when + told, client))
    done = clock[0]
    return rejected / done, longest, done


def test_a_crowd_is_told_to_come_back_when_its_turn_can_come():
    """1,000 clients at once, 20 admitted per second: a fixed 1 s brings ~500 429s a second; the
    booked retries come at about twice the admission rate, and the crowd still gets in as fast
    as the servers take it (50 s)."""
    fixed = _storm(lambda clock: type("Fixed", (), {"admitted": lambda self: None, "rejected": lambda self: 1})())
    rate, longest, done = _storm(lambda clock: RetryAfter(clock=clock))
    assert fixed[0] > 300 and fixed[2] < 1.1 * 50, fixed
    assert rate < 2.5 * 20 and 20 <= longest <= 30 and done < 1.1 * 50, (rate, longest, done)


def _probes(sat: Saturation, lags: list[float], start: float | None = None) -> float:
    now = time.monotonic() if start is None else start
    for lag in lags:
        now += PROBE_INTERVAL_S + lag
        sat.record(now, lag)
    return now


def test_one_late_probe_is_a_burst_not_an_overload():
    sat = Saturation(lambda: 0.0, max_lag_s=LIMIT)
    _probes(sat, [0.0, 0.5, 0.0])
    assert sat.overload() is None and sat.admit(100) is None
    _probes(sat, [0.2] * SUSTAINED)
    assert sat.overload() == "loop_lag"


def test_a_lagging_control_backlog_is_an_overload():
    age = [0.0]
    sat = Saturation(lambda: age[0], max_lag_s=LIMIT)
    age[0] = 0.3
    _probes(sat, [0.0] * SUSTAINED)
    assert sat.overload() == "control_backlog"


def test_no_limit_no_shedding():
    sat = Saturation(lambda: 10.0, max_lag_s=None)
    _probes(sat, [5.0] * SUSTAINED)
    assert sat.admit(1000) is None


def test_the_in_flight_limit_binds_until_calm_then_lifts():
    sat = Saturation(lambda: 0.0, max_lag_s=LIMIT)
    now = _probes(sat, [0.3] * SUSTAINED)
    assert sat.admit(100) == "loop_lag"
    assert sat.limit == 90
    sat._last_overload = now  # the refusal above, on the probes' clock
    now = _probes(sat, [0.0] * SUSTAINED, now)  # calm again, but not for CALM_S yet
    assert sat.overload() is None
    assert sat.admit(95) == "in_flight_limit" and sat.admit(50) is None
    _probes(sat, [0.0] * int(CALM_S / PROBE_INTERVAL_S + 1400), now)
    assert sat.limit is None and sat.admit(10_000) is None


def test_refusals_lower_the_limit_once_per_period_not_each():
    sat = Saturation(lambda: 0.0, max_lag_s=LIMIT)
    _probes(sat, [0.3] * SUSTAINED)
    for _ in range(100):  # a storm of new requests in one moment of overload
        assert sat.admit(100) == "loop_lag"
    assert sat.limit == 90
    sat._last_decrease -= DECREASE_EVERY_S
    assert sat.admit(100) == "loop_lag" and sat.limit == 81


def test_overloaded_router_answers_429_keeps_accepted_streams_and_recovers(tokenizer):
    async def hog(stop: asyncio.Event) -> None:
        while not stop.is_set():  # the loop runs the 50 ms probe's timer ~150 ms late (the limit: 100 ms)
            time.sleep(0.2)
            await asyncio.sleep(0)

    async def scenario():
        async with serving(tokenizer, *split_pair(token_delay_s=0.02)) as h:
            accepted = asyncio.create_task(h.stream("/v1/completions", {"prompt": [5], "max_tokens": 40,
                                                                       "ignore_eos": True}))
            await asyncio.sleep(0.1)
            stop = asyncio.Event()
            hogging = asyncio.create_task(hog(stop))
            await asyncio.sleep(1.0)  # several probes, all late
            resp = await h.client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            body = await resp.json()
            shed = await scrape(h)
            stop.set()
            await hogging
            events = await accepted
            await asyncio.sleep(1.5)  # the lag window passes
            status, _ = await h.post("/v1/completions", {"prompt": [5], "max_tokens": 2, "ignore_eos": True})
            after = await scrape(h)
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert body["error"]["code"] == 429 and body["error"]["type"] == "RateLimitError"
        assert "overloaded" in body["error"]["message"]
        assert value(shed, "pdserve_router_requests_shed_total", reason="loop_lag") == 1
        assert value(shed, "pdserve_request_errors_total", code="429") == 1
        assert value(shed, "pdserve_router_loop_lag_seconds") > 0.1
        assert value(shed, "pdserve_router_event_loop_lag_seconds_count") > 5
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"  # not shed
        assert status == 200  # recovered
        assert value(after, "pdserve_num_requests_running") == 0

    run(scenario())


def test_saturation_and_stage_metrics_are_exported(tokenizer):
    async def scenario():
        async with serving(tokenizer, *split_pair(token_delay_s=0.005)) as h:
            before = await scrape(h)
            events = await h.stream("/v1/completions", {"prompt": [9, 9], "max_tokens": 6, "ignore_eos": True})
            assert events[-1] == "[DONE]"
            after = await scrape(h)
        for name in ("pdserve_router_loop_lag_seconds", "pdserve_router_control_backlog",
                     "pdserve_router_control_backlog_age_seconds", "pdserve_router_in_flight_limit"):
            assert (name, frozenset()) in after, name
        for reason in ("loop_lag", "control_backlog", "in_flight_limit"):
            assert value(before, "pdserve_router_requests_shed_total", reason=reason) == 0
        # Tokens 1..5 came in TokenBatches (decode, detokenize); all 6 went out as events (sse, write).
        tokens = {s: value(after, "pdserve_router_token_stage_tokens_total", stage=s) for s in
                  ("decode", "detokenize", "sse", "write")}
        assert tokens == {"decode": 5, "detokenize": 5, "sse": 6, "write": 6}
        for stage in tokens:
            assert value(after, "pdserve_router_token_stage_seconds_total", stage=stage) > 0, stage

    run(scenario())


def test_lag_without_the_routers_own_work_is_co_tenant_noise_not_overload():
    """Timers fire late while other processes hold the core, but the loop's thread barely ran:
    shedding would turn clients away for load the router does not have."""
    sat = Saturation(lambda: 0.0, max_lag_s=LIMIT)
    now = time.monotonic()
    for _ in range(SUSTAINED):
        now += PROBE_INTERVAL_S + 0.3
        sat.record(now, 0.3, busy=0.05)
    assert sat.overload() is None and sat.admit(100) is None and sat.busy_ratio() == pytest.approx(0.05)
    for _ in range(SUSTAINED):  # the same lag while the loop itself is busy: overload
        now += PROBE_INTERVAL_S + 0.3
        sat.record(now, 0.3, busy=0.9)
    assert sat.overload() == "loop_lag"


def test_the_probe_measures_the_loops_own_cpu_time():
    async def scenario(spin: bool) -> float:
        sat = Saturation(lambda: 0.0, max_lag_s=LIMIT)
        task = asyncio.create_task(sat.probe_loop())
        deadline = time.monotonic() + 0.6
        while time.monotonic() < deadline:
            if spin:  # the loop's own work: 20 ms turns of pure Python
                end = time.monotonic() + 0.02
                while time.monotonic() < end:
                    pass
            await asyncio.sleep(0 if spin else 0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return sat.busy_ratio()

    assert asyncio.run(scenario(spin=False)) < 0.3
    assert asyncio.run(scenario(spin=True)) > 0.5
