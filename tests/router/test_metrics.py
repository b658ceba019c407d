"""Router metrics: requests through fake nodes move the counters and histograms at GET /metrics;
errors are counted by status; TTFT stages add up to TTFT."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.metrics import TTFT_STAGES, RouterMetrics
from pdserve.router.request_state import RouterRequest
from tests.router.conftest import run, serving, split_pair, wait_until
from tests.router.fake_node import FakeNode


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} from Prometheus text."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics.get((name, frozenset(labels.items())), 0.0)


async def scrape(h) -> dict:
    resp = await h.client.get("/metrics")
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
    return samples(await resp.text())


def test_completed_requests_move_counters_and_histograms(tokenizer):
    async def scenario():
        async with serving(tokenizer, *split_pair(token_delay_s=0.01)) as h:
            before = await scrape(h)
            assert value(before, "pdserve_nodes", role="prefill") == 1
            assert value(before, "pdserve_nodes_ready", role="decode") == 1
            assert value(before, "pdserve_time_to_first_token_seconds_count") == 0
            status, _ = await h.post("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 5, "ignore_eos": True})
            assert status == 200
            events = await h.stream("/v1/completions", {"prompt": [9, 9], "max_tokens": 4, "ignore_eos": True})
            assert events[-1] == "[DONE]"
            m = await scrape(h)
        assert value(m, "pdserve_request_success_total", finished_reason="length") == 2
        assert value(m, "pdserve_prompt_tokens_total") == 5
        assert value(m, "pdserve_generation_tokens_total") == 9
        for name in ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds",
                     "pdserve_time_per_output_token_seconds"):
            assert value(m, name + "_count") == 2, name
            assert value(m, name + "_sum") > 0, name
        assert value(m, "pdserve_inter_token_latency_seconds_count") == (5 - 1) + (4 - 1)
        for stage in TTFT_STAGES:
            assert value(m, "pdserve_ttft_stage_seconds_count", stage=stage) == 2
        assert value(m, "pdserve_num_requests_running") == 0
        assert not any(v for (name, _), v in m.items() if name == "pdserve_request_errors_total")  # all 0

    run(scenario())


def test_errors_are_counted_by_status(tokenizer):
    async def scenario():
        async with serving(tokenizer) as h:
            assert (await h.post("/v1/completions", {"prompt": "hi"}))[0] == 503  # no node
            assert (await h.post("/v1/completions", {"prompt": "hi", "max_tokens": -1}))[0] == 400
            await h.add_node(FakeNode("n0", "both", fail="boom"))
            assert (await h.post("/v1/completions", {"prompt": "hi"}))[0] == 500  # the node's Error
            m = await scrape(h)
        assert value(m, "pdserve_request_errors_total", code="503") == 1
        assert value(m, "pdserve_request_errors_total", code="400") == 1
        assert value(m, "pdserve_request_errors_total", code="500") == 1
        assert value(m, "pdserve_nodes", role="both") == 1

    run(scenario())


def test_abort_counts_as_finished_reason_abort(tokenizer):
    async def scenario():
        async with serving(tokenizer, *split_pair(token_delay_s=0.05)) as h:
            parsed = h.router.parse("completion", {"prompt": [3, 4], "max_tokens": 50})
            req = await h.router.submit("cmpl-abort", parsed)
            await wait_until(lambda: len(req.output_token_ids) >= 2, what="two tokens")
            assert value(await scrape(h), "pdserve_num_requests_running") == 1
            await h.router.release(req)  # the client went away
            m = await scrape(h)
        assert value(m, "pdserve_request_success_total", finished_reason="abort") == 1
        assert value(m, "pdserve_e2e_request_latency_seconds_count") == 1
        assert value(m, "pdserve_num_requests_running") == 0

    run(scenario())


def test_ttft_stages_add_up_and_clamp():
    metrics = RouterMetrics()
    req = RouterRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), tokenizer=None)
    t = req.timing
    t.arrival, t.dispatched, t.first_token = 100.0, 100.5, 103.0
    t.prefill_queued_s, t.prefill_s = 1.0, 1.0
    metrics.observe_first_token(req)
    got = {s.labels["stage"]: s.value for f in metrics.registry.collect() if f.name == "pdserve_ttft_stage_seconds"
           for s in f.samples if s.name.endswith("_sum")}
    assert got == {"router_queue": 0.5, "prefill_queue": 1.0, "prefill": 1.0, "first_token_delivery": 0.5}
    t.prefill_s = 5.0  # clocks of two machines disagree: delivery clamps at 0, it never goes negative
    metrics.observe_first_token(req)
    got = {s.labels["stage"]: s.value for f in metrics.registry.collect() if f.name == "pdserve_ttft_stage_seconds"
           for s in f.samples if s.name.endswith("_sum")}
    assert got["first_token_delivery"] == 0.5


def test_two_routers_in_one_process_keep_separate_registries():
    a, b = RouterMetrics(), RouterMetrics()
    a.observe_error(409)  # not one of the codes every router pre-creates at 0
    # match the label, not the digits: a *_created timestamp can contain "409" by chance
    assert b'code="409"' in _render(a) and b'code="409"' not in _render(b)


def _render(metrics: RouterMetrics) -> bytes:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry)


def test_error_and_finish_series_exist_before_any_request():
    """A dashboard's error-rate and finish-reason panels read 0, not "no data", on a fresh router."""
    from pdserve.router.metrics import COMMON_ERROR_CODES

    m = samples(_render(RouterMetrics()).decode())
    for code in COMMON_ERROR_CODES:
        assert ("pdserve_request_errors_total", frozenset({("code", code)})) in m
    for reason in ("stop", "length", "abort"):
        assert m[("pdserve_request_success_total", frozenset({("finished_reason", reason)}))] == 0


def test_bulk_histogram_exports_what_a_prometheus_histogram_would():
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from pdserve.router.metrics import TOKEN_BUCKETS, BulkHistogram

    reference_registry, bulk_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", registry=reference_registry, buckets=TOKEN_BUCKETS)
    bulk = BulkHistogram("x_seconds", "doc", TOKEN_BUCKETS)
    bulk_registry.register(bulk)
    rng = random.Random(0)
    values = [rng.choice([0.0, 0.001, 0.0025, 80.0, 1e9, rng.random(), rng.random() * 10]) for _ in range(2000)]
    for v in values:
        reference.observe(v)
    bulk.observe_many(values[:700])
    bulk.observe_many(values[700:])

    def lines(registry):
        return [line for line in generate_latest(registry).decode().splitlines()
                if "_created" not in line and "_sum" not in line]

    assert lines(bulk_registry) == lines(reference_registry)
    assert value(samples(generate_latest(bulk_registry).decode()), "x_seconds_sum") == pytest.approx(sum(values))
