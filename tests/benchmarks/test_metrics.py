"""Summary math on hand-built records: throughputs, TPOT, pooled ITL, percentiles, goodput, SLO parsing."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import parse_percentiles, parse_slos, percentile_key, summarize
from tests.benchmarks.conftest import make_record


def records():
    # TTFTs 100..400 ms; request i has i+1 gaps of 10*(i+1) ms, so TPOT = 10*(i+1) ms
    good = [make_record(i, ttft_ms=100.0 * (i + 1), itl_ms=[10.0 * (i + 1)] * (i + 1)) for i in range(4)]
    return good + [make_record(9, success=False, error="HTTP 500: boom")]


def test_counts_tokens_and_throughputs_over_successful_requests_only():
    s = summarize(records(), duration_s=2.0, percentiles=[50, 99])
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_input_tokens"] == 40
    assert s["total_output_tokens"] == 2 + 3 + 4 + 5
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(7.0)
    assert s["total_token_throughput"] == pytest.approx(27.0)
    assert s["errors"] == {"HTTP 500: boom": 1}


def test_latency_stats_and_percentiles():
    s = summarize(records(), duration_s=2.0, percentiles=[50, 90, 99])
    assert s["mean_ttft_ms"] == pytest.approx(250.0)
    assert s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p50_ttft_ms"] == pytest.approx(250.0)
    assert s["p90_ttft_ms"] == pytest.approx(370.0)  # linear: 100 + 0.9 * 3 * 100
    assert s["p99_ttft_ms"] == pytest.approx(397.0)
    assert s["mean_tpot_ms"] == pytest.approx(25.0)  # (E2E - TTFT) / (n - 1) = the gap here
    # ITL pools every gap: 1x10, 2x20, 3x30, 4x40
    assert s["mean_itl_ms"] == pytest.approx((10 + 40 + 90 + 160) / 10)
    assert s["median_itl_ms"] == pytest.approx(30.0)
    assert s["mean_e2el_ms"] == pytest.approx((110 + 240 + 390 + 560) / 4)


def test_single_token_requests_have_no_tpot_and_empty_runs_are_zero():
    s = summarize([make_record(0, itl_ms=[])], 1.0, [99])
    assert s["mean_tpot_ms"] == 0.0 and s["p99_itl_ms"] == 0.0
    empty = summarize([], 1.0, [99])
    assert empty["completed"] == 0 and empty["p99_ttft_ms"] == 0.0


def test_goodput_counts_requests_meeting_every_slo():
    rs = records()
    assert summarize(rs, 2.0, [99], {"ttft": 250.0})["num_good"] == 2
    both = summarize(rs, 2.0, [99], {"ttft": 350.0, "tpot": 15.0})
    assert both["num_good"] == 1 and both["request_goodput"] == pytest.approx(0.5)
    e2e = summarize(rs, 2.0, [99], {"e2el": 300.0})
    assert e2e["num_good"] == 2  # 110 and 240 ms
    assert summarize(rs, 2.0, [99])["request_goodput"] is None


def test_parse_slos_and_percentiles():
    assert parse_slos(["ttft:500", "tpot:50", "e2e:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_slos(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert percentile_key(99.9) == "p99.9" and percentile_key(50.0) == "p50"
    with pytest.raises(ValueError):
        parse_percentiles("101")
