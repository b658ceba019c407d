"""The SSE client against the fake server: TTFT and ITL match the server's delays, usage is read,
failures become records, and a benchmark run with failures still completes."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.client import EndpointConfig, _StreamState, build_body, send_request, spread_tokens
from pdserve.bench.datasets import SampleRequest
from pdserve.bench.runner import BenchmarkRun, LoadConfig, run_benchmark
from tests.benchmarks.conftest import run
from tests.benchmarks.fake_openai import FAIL_HTTP, FAIL_STREAM, MODEL


def config(fake, endpoint="/v1/completions", **kw) -> EndpointConfig:
    return EndpointConfig(fake.url + endpoint, MODEL, **kw)


async def one(cfg, sample, request_id=0):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        return await send_request(session, cfg, sample, request_id)


def test_ttft_itl_and_usage_are_measured(fake):
    fake.ttft_s, fake.itl_s = 0.15, 0.05
    record = run(one(config(fake, ignore_eos=True), SampleRequest([11, 12, 13], 3, 5)))
    assert record.success, record.error
    assert record.output_len == 5 and record.generated_text == "t0t1t2t3t4"
    assert 0.14 <= record.ttft_s < 2.0  # upper bounds are loose: the test machine may be busy
    assert len(record.itl_s) == 4 and all(0.03 <= gap < 1.0 for gap in record.itl_s)
    assert record.e2el_s >= record.ttft_s + sum(record.itl_s) - 1e-6
    assert 0.03 <= record.tpot_s < 1.0
    body = fake.bodies[-1]
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["prompt"] == [11, 12, 13]


def test_without_usage_counts_token_ids_or_chunks(fake):
    fake.ttft_s = fake.itl_s = 0.0
    fake.send_usage = False
    fake.tokens_per_chunk = 2
    with_ids = run(one(config(fake), SampleRequest([11], 1, 5)))  # chunks of 1, 2, 2 tokens
    assert with_ids.output_len == 5 and fake.bodies[-1]["return_token_ids"] is True
    fake.tokens_per_chunk = 1
    chunks = run(one(config(fake, return_token_ids=False), SampleRequest([11], 1, 3)))
    assert chunks.output_len == 3 and "return_token_ids" not in fake.bodies[-1]


def stream_of(chunks: list[tuple[float, int]], usage: int | None = None, ids: bool = True) -> _StreamState:
    """A stream whose output chunks arrived at the given times with that many tokens each."""
    state = _StreamState(0.0)
    for now, k in chunks:
        choice = {"text": "x" * k, **({"token_ids": list(range(k))} if ids else {})}
        state.on_event({"choices": [choice]}, now)
    if usage is not None:
        state.on_event({"choices": [], "usage": {"completion_tokens": usage}}, chunks[-1][0])
    return state


def test_a_chunk_of_k_tokens_adds_k_itl_samples():
    # first token at 1.0, then 4 tokens at 1.4 and 2 at 1.6: eight tokens 0.1 s apart
    with_ids = stream_of([(1.0, 1), (1.4, 4), (1.6, 2)])
    assert with_ids.itl() == pytest.approx([0.1] * 6) and with_ids.output_len() == 7
    # a chunk with text but no ids (the server sent ids elsewhere) passes its gap on to the next
    state = stream_of([(1.0, 1), (1.2, 2)])
    state.on_event({"choices": [{"text": "!", "token_ids": []}]}, 1.3)
    state.on_event({"choices": [{"text": "y", "token_ids": [5]}]}, 1.4)
    assert state.itl() == pytest.approx([0.1, 0.1, 0.2])
    # usage only: the total is spread over the gaps, the extra tokens to the longest gaps first
    usage_only = stream_of([(1.0, 1), (1.2, 1), (1.8, 1)], usage=6, ids=False)
    assert sorted(usage_only.itl()) == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.2])
    assert usage_only.output_len() == 6
    # no ids, no usage: one token per chunk, as before
    assert stream_of([(1.0, 1), (1.5, 3)], ids=False).itl() == pytest.approx([0.5])


def test_spread_tokens_gives_every_gap_one_and_the_rest_to_the_longest():
    assert spread_tokens([0.1, 0.3, 0.2], 3) == [1, 1, 1]
    assert spread_tokens([0.1, 0.3, 0.2], 8) == [2, 3, 3]
    assert spread_tokens([0.1, 0.3], 1) == [1, 1]  # fewer tokens than gaps: chunks are all we know
    assert spread_tokens([], 4) == []


def test_chat_endpoint_sends_messages(fake):
    fake.ttft_s = fake.itl_s = 0.0
    record = run(one(config(fake, "/v1/chat/completions"), SampleRequest("hello world", 2, 3)))
    assert record.success and record.output_len == 3 and record.prompt_len == 2
    assert fake.bodies[-1]["messages"] == [{"role": "user", "content": "hello world"}]
    with pytest.raises(ValueError):
        build_body(config(fake, "/v1/chat/completions"), SampleRequest([1, 2], 2, 3))


def test_failures_become_records(fake):
    fake.ttft_s = fake.itl_s = 0.0
    http = run(one(config(fake), SampleRequest([FAIL_HTTP, 1], 2, 3)))
    assert not http.success and http.error.startswith("HTTP 500") and "boom" in http.error
    stream = run(one(config(fake), SampleRequest([FAIL_STREAM, 1], 2, 3)))
    assert not stream.success and "node died" in stream.error
    refused = run(one(EndpointConfig("http://127.0.0.1:9/v1/completions", MODEL), SampleRequest([1], 1, 1)))
    assert not refused.success and refused.error


def test_run_with_failures_completes_and_keeps_order_of_ids(fake):
    fake.ttft_s, fake.itl_s = 0.01, 0.005
    samples = [SampleRequest([FAIL_HTTP if i % 4 == 0 else 11, 12], 2, 3) for i in range(12)]
    result = run(run_benchmark(config(fake), samples, LoadConfig(request_rate=200.0, max_concurrency=3,
                                                                 num_warmups=2, disable_tqdm=True),
                               BenchmarkRun()))
    assert len(result.records) == 12 and result.duration_s > 0 and not result.interrupted
    assert sorted(r.request_id for r in result.records) == list(range(12))
    assert sum(not r.success for r in result.records) == 3
    assert len(fake.bodies) == 14  # two warm-ups too


def test_concurrency_cap_bounds_requests_in_flight(fake):
    fake.ttft_s, fake.itl_s = 0.05, 0.0
    samples = [SampleRequest([11], 1, 1) for _ in range(8)]
    result = run(run_benchmark(config(fake), samples, LoadConfig(math.inf, max_concurrency=2, disable_tqdm=True),
                               BenchmarkRun()))
    starts = sorted(r.start_s for r in result.records)
    # two at a time, each ~50 ms: the last pair starts after three earlier rounds
    assert starts[-1] >= 0.14 and result.duration_s >= 0.19
