"""Benchmark-client test factories: a fake OpenAI server in a thread, and plain-value records."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.request_record import RequestRecord
from tests.benchmarks.fake_openai import FakeOpenAI, ServerThread


@pytest.fixture
def fake():
    server = ServerThread(FakeOpenAI())
    yield server.fake
    server.stop()


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def make_record(request_id: int = 0, *, ttft_ms: float = 100.0, itl_ms: list[float] = (), output_len: int | None = None,
                prompt_len: int = 10, success: bool = True, error: str = "") -> RequestRecord:
    """A successful record whose E2E is TTFT plus its gaps (each gap one token unless output_len says)."""
    itl = [ms / 1000 for ms in itl_ms]
    return RequestRecord(request_id, prompt_len, max_tokens=len(itl) + 1, success=success, error=error,
                         ttft_s=ttft_ms / 1000, itl_s=itl, e2el_s=ttft_ms / 1000 + sum(itl),
                         output_len=len(itl) + 1 if output_len is None else output_len)
