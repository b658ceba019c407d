"""The periodic stats line: throughputs over the interval, values at its end, quiet while idle."""

from __future__ import annotations

import logging

from pdserve.node.metrics import NodeSnapshot
from pdserve.node.stats import StatsLogger, stats_line


def snap(**kw) -> NodeSnapshot:
    base = dict(num_running=0, num_waiting=0, num_blocks_used=0, num_blocks_total=200, num_prefix_queries=0,
                num_prefix_hits=0, num_preemptions=0)
    return NodeSnapshot(**{**base, **kw})


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_line_content():
    first = snap(num_prompt_tokens=1000, num_generation_tokens=50, num_prefix_queries=100, num_prefix_hits=10,
                 num_bytes_sent=1_000_000)
    last = snap(num_prompt_tokens=6000, num_generation_tokens=70, num_prefix_queries=300, num_prefix_hits=90,
                num_bytes_sent=51_000_000, num_running=2, num_waiting=5, num_blocks_used=25)
    line = stats_line("prefill-1", "prefill", first, last, 10.0)
    assert line == ("prefill-1: prompt 500.0 tok/s, generation 2.0 tok/s, running 2 reqs, waiting 5 reqs, "
                    "KV cache 12.5%, prefix cache hit rate 40.0%, KV sent 5.0 MB/s")
    decode = stats_line("decode-1", "decode", snap(), snap(num_bytes_received=2_000_000), 2.0)
    assert decode.endswith("prefix cache hit rate 0.0%, KV received 1.0 MB/s")
    assert "KV sent" not in stats_line("both-1", "both", snap(), snap(), 1.0)  # colocated: no hand-off
    assert stats_line("p", "prefill", snap(), snap(num_bytes_sent=123_000), 1.0).endswith("KV sent 123.0 kB/s")
    assert stats_line("p", "prefill", snap(), snap(num_bytes_sent=4_500_000_000), 1.0).endswith("KV sent 4.5 GB/s")


def test_logs_every_interval_while_busy_and_stays_quiet_when_idle(caplog):
    clock = FakeClock()
    state = {"snap": snap()}
    stats = StatsLogger("decode-1", "decode", lambda: state["snap"], interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="pdserve.node.stats"):
        clock.now += 5
        state["snap"] = snap(num_generation_tokens=100, num_running=3, num_blocks_used=50)
        assert stats.maybe_log() is None  # the interval is not over
        clock.now += 5
        line = stats.maybe_log()
        assert line is not None and "generation 10.0 tok/s" in line and "running 3 reqs" in line
        assert "KV cache 25.0%" in line and line in caplog.text
        clock.now += 10
        state["snap"] = snap(num_generation_tokens=150)  # finished during the interval: one last line
        assert "generation 5.0 tok/s, running 0 reqs" in stats.maybe_log()
        clock.now += 10
        assert stats.maybe_log() is None  # idle: nothing moved, nothing held
        clock.now += 30
        state["snap"] = snap(num_generation_tokens=450, num_running=1)
        assert "generation 10.0 tok/s" in stats.maybe_log()  # over the time since the last interval
    assert caplog.text.count("decode-1:") == 3
