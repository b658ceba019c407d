"""Trace replay (Azure LLM inference trace format), the shifting workload, the shipped synthetic
trace, and `pdserve bench serve --dataset-name trace|shifting` against the fake server."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pdserve.bench.cli import main
from pdserve.bench.datasets import length_requests
from pdserve.bench.traces import (
    TraceRequest,
    load_azure_trace,
    shifting_trace,
    synthetic_trace,
    write_azure_trace,
)
from pdserve.bench.traces import main as traces_main

ROOT = Path(__file__).resolve().parents[2]
SYNTHETIC = ROOT / "benchmarks" / "traces" / "azure_synthetic.csv"
SYNTHETIC_ROWS = 318  # documented in docs/benchmarks.md and benchmarks/traces/README.md
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write(tmp_path, text: str, name: str = "t.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- load_azure_trace ------------------------------------------------------------------------
def test_datetime_timestamps_with_seven_fractional_digits(tmp_path):
    path = write(tmp_path, HEADER + "2023-11-16 18:15:46.6805900,374,44\n"
                                    "2023-11-16 18:15:50.9951690,396,109\n"
                                    "2023-11-16 18:15:47.1000000,879,0\n")  # out of order: sorted
    reqs = load_azure_trace(path)
    assert [(r.input_len, r.output_len) for r in reqs] == [(374, 44), (879, 0), (396, 109)]
    assert reqs[0].arrival_s == 0.0
    assert reqs[1].arrival_s == pytest.approx(0.41941, abs=1e-6)
    assert reqs[2].arrival_s == pytest.approx(4.314579, abs=1e-6)
    assert all(r.phase == "" for r in reqs)


def test_float_seconds_time_scale_and_max_requests(tmp_path):
    path = write(tmp_path, HEADER + "10.5,100,10\n11.5,200,20\n14.5,300,30\n")
    assert [r.arrival_s for r in load_azure_trace(path)] == [0.0, 1.0, 4.0]
    reqs = load_azure_trace(path, time_scale=0.5, max_requests=2)
    assert reqs == [TraceRequest(0.0, 100, 10), TraceRequest(0.5, 200, 20)]


def test_extra_columns_and_blank_lines_are_fine(tmp_path):
    path = write(tmp_path, "ContextTokens,TIMESTAMP,Note,GeneratedTokens\n5,0.0,a,1\n\n7,2.0,b,3\n")
    assert load_azure_trace(path) == [TraceRequest(0.0, 5, 1), TraceRequest(2.0, 7, 3)]


@pytest.mark.parametrize("body, match", [
    ("0.0,10,5\n1.0,abc,5\n", r"line 3: ContextTokens 'abc' is not an integer"),
    ("0.0,10,5\n1.0,10,5\n2.0,10,-1\n", r"line 4: GeneratedTokens -1 is negative"),
    ("0.0,10,5\nyesterday,10,5\n", r"line 3: timestamp 'yesterday' is neither seconds nor a date"),
    ("0.0,10,5\n2023-11-16 18:15:46.1,10,5\n", r"line 3: mixes float-seconds and datetime"),
    ("0.0,10\n", r"line 2: 2 fields, the header has 3"),
    ("nan,1,1\n", r"line 2: timestamp 'nan' is not finite"),
    ("", r"header but no requests"),
])
def test_bad_rows_name_their_line(tmp_path, body, match):
    with pytest.raises(ValueError, match=match):
        load_azure_trace(write(tmp_path, HEADER + body))


def test_missing_file_and_bad_header(tmp_path):
    with pytest.raises(ValueError, match=r"trace file .*nope.csv does not exist"):
        load_azure_trace(tmp_path / "nope.csv")
    with pytest.raises(ValueError, match=r"line 1: the header must name TIMESTAMP,ContextTokens,GeneratedTokens"):
        load_azure_trace(write(tmp_path, "time,in,out\n0,1,1\n"))
    with pytest.raises(ValueError, match="an empty line"):
        load_azure_trace(write(tmp_path, ""))
    with pytest.raises(ValueError, match="time scale"):
        load_azure_trace(write(tmp_path, HEADER + "0,1,1\n"), time_scale=0)


def test_write_then_load_round_trips_in_the_azure_datetime_form(tmp_path):
    reqs = [TraceRequest(0.0, 10, 2, "a"), TraceRequest(1.23456789, 20, 3, "b"), TraceRequest(3600.5, 30, 4)]
    path = tmp_path / "out" / "trace.csv"
    write_azure_trace(path, reqs)
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER.strip()
    assert lines[1] == "2023-11-16 18:00:00.0000000,10,2"
    assert lines[2] == "2023-11-16 18:00:01.2345679,20,3"  # 7 digits, as Azure's
    assert lines[3].startswith("2023-11-16 19:00:00.5000000")
    back = load_azure_trace(path)
    assert [(r.input_len, r.output_len) for r in back] == [(10, 2), (20, 3), (30, 4)]
    assert [r.arrival_s for r in back] == pytest.approx([r.arrival_s for r in reqs], abs=1e-6)


# ---- shifting_trace --------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0])
def test_shifting_mean_rate_and_duration(burstiness):
    reqs = shifting_trace(period_s=20, rate=5.0, duration_s=400, burstiness=burstiness, seed=3, scale=0.01)
    assert reqs[0].arrival_s == 0.0 and reqs[-1].arrival_s < 400
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert len(reqs) / 400 == pytest.approx(5.0, rel=0.12)  # 2000 expected
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    mean = sum(gaps) / len(gaps)
    cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.3)  # the gamma shape shows in the gaps


def test_shifting_phases_cycle_at_period_boundaries():
    phases = (("a", 100, 10), ("b", 20, 300))
    reqs = shifting_trace(phases=phases, period_s=2.0, rate=20.0, duration_s=13.0, seed=1, scale=0.5)
    for r in reqs:
        expected = "ab"[int(r.arrival_s // 2.0) % 2]
        assert r.phase == expected, r
        assert (r.input_len, r.output_len) == ((50, 5) if expected == "a" else (10, 150))  # scaled, no range
    # every one of the 7 periods (a b a b a b a) has requests: a boundary is crossed each time
    assert {int(r.arrival_s // 2.0) for r in reqs} == set(range(7))


def test_shifting_default_phases_range_ratio_and_seed():
    kw = dict(period_s=10, rate=4.0, duration_s=60, range_ratio=0.5, scale=0.1)
    reqs = shifting_trace(**kw)
    assert reqs == shifting_trace(**kw)  # seeded
    assert reqs != shifting_trace(**kw, seed=1)
    assert set(Counter(r.phase for r in reqs)) == {"chat", "summarize", "generate"}
    for r in reqs:
        base_in, base_out = {"chat": (100, 20), "summarize": (400, 10), "generate": (20, 100)}[r.phase]
        assert base_in * 0.5 <= r.input_len <= base_in * 1.5 and base_out * 0.5 <= r.output_len <= base_out * 1.5
    assert len({r.input_len for r in reqs if r.phase == "chat"}) > 3  # the range is used


@pytest.mark.parametrize("kw, match", [
    (dict(period_s=0), "period_s"), (dict(rate=float("inf")), "rate"), (dict(duration_s=-1), "duration_s"),
    (dict(scale=0), "scale"), (dict(phases=()), "at least one phase"), (dict(phases=(("x", 0, 5),)), "a phase is"),
    (dict(burstiness=0), "burstiness"), (dict(range_ratio=1.5), "range ratio"),
])
def test_shifting_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        shifting_trace(**{"period_s": 1.0, "rate": 1.0, "duration_s": 5.0, **kw})


# ---- the shipped synthetic trace -------------------------------------------------------------
def test_synthetic_trace_file_loads_with_the_documented_row_count():
    reqs = load_azure_trace(SYNTHETIC)
    assert len(reqs) == SYNTHETIC_ROWS
    assert SYNTHETIC.read_text().startswith(HEADER + "2023-11-16 18:00:00.0000000,")
    assert f"{SYNTHETIC_ROWS} rows" in (ROOT / "docs" / "benchmarks.md").read_text()
    assert 150 < reqs[-1].arrival_s < 180


def test_synthetic_trace_file_is_what_the_documented_command_writes(tmp_path):
    path = tmp_path / "synthetic.csv"
    assert traces_main(["--write-synthetic", str(path)]) == 0
    assert path.read_text() == SYNTHETIC.read_text()
    assert len(synthetic_trace()) == SYNTHETIC_ROWS


def test_length_requests_builds_random_prompts_of_the_given_lengths():
    samples = length_requests([(5, 3), (0, 0), (12, 1)], vocab_size=256, seed=2)
    assert [(len(s.prompt), s.prompt_len, s.output_len) for s in samples] == [(5, 5, 3), (1, 1, 1), (12, 12, 1)]
    assert all(10 <= t < 256 for s in samples for t in s.prompt)
    text = length_requests([(4, 2)], vocab_size=256, as_text=True)[0]
    assert isinstance(text.prompt, str) and len(text.prompt.split()) == 4


# ---- CLI against the fake server -------------------------------------------------------------
def test_cli_replays_a_trace_at_its_arrival_times(fake, tmp_path, capsys):
    fake.ttft_s, fake.itl_s = 0.01, 0.002
    trace = write(tmp_path, HEADER + "100.0,6,3\n100.4,9,2\n101.2,4,5\n101.0,7,1\n")
    out = tmp_path / "trace.json"
    code = main(["serve", "--base-url", fake.url, "--dataset-name", "trace", "--trace-path", str(trace),
                 "--trace-time-scale", "0.5", "--num-prompts", "3", "--disable-tqdm", "--save-json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "keeps the first 3" in text and "rates=trace" in text
    (run,) = json.loads(out.read_text())["runs"]
    reqs = sorted(run["requests"], key=lambda r: r["request_id"])
    assert [(r["prompt_len"], r["max_tokens"]) for r in reqs] == [(6, 3), (9, 2), (7, 1)]
    for r, offset in zip(reqs, [0.0, 0.2, 0.5]):  # arrivals halved; 101.2 is 4th by time, cut by --num-prompts
        assert offset - 0.005 <= r["start_s"] < offset + 0.15, (r["start_s"], offset)
    assert run["request_rate"] == "4"  # 2 gaps over 0.5 s: the trace's mean rate labels the run


def test_cli_shifting_prints_per_phase_summaries(fake, tmp_path, capsys):
    fake.ttft_s, fake.itl_s = 0.01, 0.001
    out = tmp_path / "shift.json"
    code = main(["serve", "--base-url", fake.url, "--dataset-name", "shifting", "--shift-period", "0.4",
                 "--shift-duration", "1.2", "--shift-scale", "0.01", "--request-rate", "25", "--disable-tqdm",
                 "--goodput", "ttft:5000", "tpot:1000", "--save-json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "| phase | requests |" in text
    for name in ("chat", "summarize", "generate"):
        assert f"| {name} |" in text
    (run,) = json.loads(out.read_text())["runs"]
    phases = run["summary"]["phases"]
    assert list(phases) == ["chat", "summarize", "generate"]
    assert sum(p["requests"] for p in phases.values()) == run["summary"]["completed"] == len(run["requests"])
    assert all(p["slo_attainment"] == 1.0 and "p90_ttft_ms" in p for p in phases.values())
    # scale 0.01: chat 10 in / 2 out, summarize 40 / 1, generate 2 / 10
    lens = {(r["prompt_len"], r["max_tokens"]) for r in run["requests"]}
    assert lens <= {(10, 2), (40, 1), (2, 10)} and len(lens) == 3


@pytest.mark.parametrize("flags, match", [
    (["--dataset-name", "trace"], "needs --trace-path"),
    (["--trace-path", "x.csv"], "--trace-path: only with --dataset-name trace"),
    (["--dataset-name", "trace", "--trace-path", "x.csv", "--request-rate", "4"], "--request-rate does not apply"),
    (["--dataset-name", "trace", "--trace-path", "x.csv", "--trace-time-scale", "0"], "--trace-time-scale must be"),
    (["--dataset-name", "shifting", "--shift-period", "5", "--request-rate", "2"], "needs --shift-period S and"),
    (["--dataset-name", "shifting", "--shift-period", "5", "--shift-duration", "10"], "finite --request-rate"),
    (["--dataset-name", "shifting", "--shift-period", "-5", "--shift-duration", "10", "--request-rate", "1"],
     "--shift-period must be a number > 0"),
    (["--shift-scale", "0.1"], "--shift-scale: only with --dataset-name shifting"),
])
def test_cli_trace_and_shifting_flag_errors_are_one_line(fake, capsys, flags, match):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--base-url", fake.url, *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert fake.bodies == []


def test_cli_missing_trace_file_is_an_error_not_a_traceback(fake, tmp_path, capsys):
    code = main(["serve", "--base-url", fake.url, "--dataset-name", "trace", "--trace-path", str(tmp_path / "no.csv")])
    assert code == 2
    assert "no.csv does not exist" in capsys.readouterr().err
