"""Goodput search (DistServe's definition): the pure bracket-and-bisect search against synthetic
attainment curves, and `pdserve bench serve --goodput-search` against the fake server."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

import pytest

from pdserve.bench.cli import main
from pdserve.bench.goodput_search import AT_MAX, BELOW_MIN, FOUND, probe_table, search_goodput
from tests.benchmarks.fake_openai import FakeOpenAI, ServerThread


def curve(knee: float, width: float = 0.0):
    """Attainment 1 up to `knee`, then falling linearly to 0 over `width` req/s (a step when 0)."""
    def attainment(rate: float) -> float:
        if rate <= knee:
            return 1.0
        return 0.0 if width == 0 else max(0.0, 1.0 - (rate - knee) / width)
    return attainment


@pytest.mark.parametrize("knee", [1.3, 3.0, 7.77, 15.99])
def test_finds_the_knee_of_a_step_curve(knee):
    result = search_goodput(curve(knee), 1.0, 16.0, 8, 0.9)
    assert result.status == FOUND
    assert result.goodput <= knee < result.upper  # the goodput is bracketed
    assert result.upper - result.goodput <= 16.0 / 2 ** 8 * 2  # and bisection narrowed the bracket
    assert result.goodput == max(p.rate for p in result.probes if p.passed)
    assert result.upper == min(p.rate for p in result.probes if not p.passed)
    assert f"goodput {result.goodput:g} req/s" in result.message


def test_target_attainment_on_a_sloped_curve():
    # attainment = 1 - (rate - 4) / 10 above 4: it crosses 0.9 at rate 5 and 0.5 at rate 9
    for target, expected in [(0.9, 5.0), (0.5, 9.0), (1.0, 4.0)]:
        result = search_goodput(curve(4.0, 10.0), 0.5, 64.0, 12, target)
        assert result.goodput == pytest.approx(expected, abs=0.05), target
        assert all(p.passed == (p.attainment >= target) for p in result.probes)


def test_brackets_by_doubling_then_bisects():
    result = search_goodput(curve(5.0), 1.0, 100.0, 2, 0.9)
    assert [p.rate for p in result.probes] == [1.0, 2.0, 4.0, 8.0, 6.0, 5.0]
    assert [p.passed for p in result.probes] == [True, True, True, False, False, True]
    assert (result.goodput, result.upper) == (5.0, 6.0)


def test_even_the_lowest_rate_fails_means_goodput_zero():
    result = search_goodput(curve(0.1), 1.0, 16.0, 5, 0.9)
    assert result.status == BELOW_MIN and result.goodput == 0.0 and result.upper == 1.0
    assert len(result.probes) == 1  # nothing above it is tried
    assert "goodput 0 req/s" in result.message and "--search-min-rate" in result.message


def test_the_highest_rate_passing_is_a_lower_bound():
    result = search_goodput(curve(100.0), 1.0, 12.0, 5, 0.9)
    assert result.status == AT_MAX and result.goodput == 12.0 and result.upper is None
    assert [p.rate for p in result.probes] == [1.0, 2.0, 4.0, 8.0, 12.0]  # the last doubling is capped at hi
    assert "lower bound" in result.message and "--search-max-rate" in result.message


def test_equal_bounds_and_zero_iterations():
    assert search_goodput(curve(3.0), 2.0, 2.0, 4, 0.9).status == AT_MAX
    result = search_goodput(curve(3.0), 1.0, 16.0, 0, 0.9)
    assert (result.goodput, result.upper, len(result.probes)) == (2.0, 4.0, 3)


@pytest.mark.parametrize("args, match", [
    ((0.0, 4.0, 3, 0.9), "0 < min rate"), ((5.0, 4.0, 3, 0.9), "min rate <= max"),
    ((1.0, float("inf"), 3, 0.9), "< inf"), ((1.0, 4.0, -1, 0.9), "iterations"), ((1.0, 4.0, 3, 0.0), "(0, 1]"),
    ((1.0, 4.0, 3, 1.5), "(0, 1]"),
])
def test_bad_search_arguments(args, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        search_goodput(curve(2.0), *args)


def test_a_probe_outside_zero_one_is_an_error():
    with pytest.raises(ValueError, match=r"attainment 1.5, not in \[0, 1\]"):
        search_goodput(lambda rate: 1.5, 1.0, 4.0, 2, 0.9)


def test_probe_table_lists_probes_in_rate_order():
    result = search_goodput(curve(5.0), 1.0, 100.0, 2, 0.9)
    table = probe_table(result, {8.0: {"request_throughput": 7.5, "p90_ttft_ms": 12.0, "p90_tpot_ms": 3.0}})
    rates = [line.split("|")[1].strip() for line in table.splitlines()[2:]]
    assert rates == ["1", "2", "4", "5", "6", "8"]
    assert "| 8 | 0.0% | no | 7.50 | 12.0 | 3.0 |" in table and "| 1 | 100.0% | yes | - | - | - |" in table


# ---- CLI against the fake server -------------------------------------------------------------
def search(fake, tmp_path, *flags: str) -> tuple[int, dict]:
    fake.ttft_s, fake.itl_s = 0.02, 0.001
    out = tmp_path / "search.json"
    code = main(["serve", "--base-url", fake.url, "--num-prompts", "4", "--random-input-len", "8",
                 "--random-output-len", "3", "--disable-tqdm", "--goodput-search", "--search-min-rate", "20",
                 "--search-max-rate", "50", "--search-iters", "1", "--save-json", str(out), *flags])
    return code, json.loads(out.read_text())


def test_cli_search_whose_highest_rate_passes_reports_a_lower_bound(fake, tmp_path, capsys):
    code, doc = search(fake, tmp_path, "--goodput", "ttft:5000", "tpot:1000")
    text = capsys.readouterr().out
    assert code == 0, text
    gs = doc["goodput_search"]
    assert gs["status"] == "at_max" and gs["goodput"] == 50.0 and gs["target"] == 0.9
    assert [p["rate"] for p in gs["probes"]] == [20.0, 40.0, 50.0]
    assert [r["request_rate"] for r in doc["runs"]] == ["20", "40", "50"]  # every probe is a full run
    assert all(len(r["requests"]) == 4 for r in doc["runs"])
    assert "probe 20 req/s: 100.0% of 4 requests meet the SLOs (pass)" in text
    assert "goodput >= 50 req/s" in text and "| rate (req/s) | attainment |" in text


def test_cli_search_where_even_the_lowest_rate_fails(fake, tmp_path, capsys):
    # the fake server's TTFT is 20 ms: a 1 ms TTFT SLO fails every request
    code, doc = search(fake, tmp_path, "--goodput", "ttft:1", "tpot:1000", "--goodput-attainment", "0.5")
    text = capsys.readouterr().out
    assert code == 0, text
    gs = doc["goodput_search"]
    assert gs["status"] == "below_min" and gs["goodput"] == 0.0 and gs["target"] == 0.5
    assert [p["attainment"] for p in gs["probes"]] == [0.0]
    assert "goodput 0 req/s: even the lowest rate probed (20 req/s)" in text


@dataclass
class QueueingFake(FakeOpenAI):
    """Serves one request at a time (the rest wait in line), so TTFT grows with the request rate."""

    lock: asyncio.Lock | None = None

    async def _generate(self, request):
        if self.lock is None:  # made on the server thread's event loop
            self.lock = asyncio.Lock()
        async with self.lock:
            return await super()._generate(request)


def test_cli_search_finds_the_rate_where_a_queueing_server_starts_missing_ttft(tmp_path, capsys):
    """30 ms a request, one at a time: at 5 req/s (seeded arrivals) the queue stays short and every
    TTFT is well under the 150 ms SLO; at 160 req/s 8 requests arrive within ~50 ms and the last
    ones wait over 150 ms, so with a 90% target (all 8 of 8) the search brackets and bisects."""
    server = ServerThread(QueueingFake(ttft_s=0.03, itl_s=0.001))
    try:
        out = tmp_path / "q.json"
        code = main(["serve", "--base-url", server.fake.url, "--num-prompts", "8", "--random-input-len", "4",
                     "--random-output-len", "1", "--disable-tqdm", "--goodput", "ttft:150", "tpot:1000",
                     "--goodput-search", "--goodput-attainment", "0.9", "--search-min-rate", "5",
                     "--search-max-rate", "160", "--search-iters", "1", "--save-json", str(out)])
    finally:
        server.stop()
    text = capsys.readouterr().out
    assert code == 0, text
    gs = json.loads(out.read_text())["goodput_search"]
    probes = {p["rate"]: p for p in gs["probes"]}
    assert probes[5.0]["passed"] and gs["status"] == "found", text
    assert 5.0 <= gs["goodput"] < gs["upper"] <= 160.0 and not probes[gs["upper"]]["passed"]
    assert gs["goodput"] == max(r for r, p in probes.items() if p["passed"])
    assert f"goodput {gs['goodput']:g} req/s" in text


@pytest.mark.parametrize("flags, match", [
    (["--goodput-search"], "needs both SLOs"),
    (["--goodput-search", "--goodput", "ttft:100"], "needs both SLOs"),
    (["--goodput-search", "--goodput", "ttft:x", "tpot:5"], "could not convert"),
    (["--goodput-search", "--goodput", "ttft:100", "tpot:5", "--sweep", "1,2"], "drop --sweep"),
    (["--goodput-search", "--goodput", "ttft:100", "tpot:5", "--request-rate", "3"], "drop --request-rate"),
    (["--goodput-search", "--goodput", "ttft:100", "tpot:5", "--search-min-rate", "8", "--search-max-rate", "4"],
     "0 < min <= max"),
    (["--goodput-search", "--goodput", "ttft:100", "tpot:5", "--search-iters", "-1"], "--search-iters must be"),
    (["--goodput-search", "--goodput", "ttft:100", "tpot:5", "--goodput-attainment", "0"], "(0, 1]"),
    (["--search-iters", "3"], "--search-iters: only with --goodput-search"),
    (["--goodput-search", "--goodput", "ttft:100", "tpot:5", "--dataset-name", "trace", "--trace-path", "x.csv"],
     "--goodput-search does not apply to --dataset-name trace"),
])
def test_cli_search_flag_errors_are_one_line(fake, capsys, flags, match):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--base-url", fake.url, *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err and len(err.strip().splitlines()) == 2  # usage + error
    assert fake.bodies == []
