"""compare.py's outputs from hand-built runs (no stacks): the markdown table, the JSON, the plots."""

from __future__ import annotations

import argparse
import json
import math

from benchmarks.compare import bar_runs, markdown_table, write_outputs
from pdserve.bench.metrics import summarize
from pdserve.bench.runner import BenchmarkRun
from tests.benchmarks.conftest import make_record


def make_run(rate: float, ttft_ms: float) -> tuple[BenchmarkRun, dict]:
    run = BenchmarkRun(request_rate=rate, start=0.0, end=2.0,
                       records=[make_record(i, ttft_ms=ttft_ms * (i + 1), itl_ms=[5.0] * 3) for i in range(4)])
    return run, summarize(run.records, run.duration_s, [50, 90, 99], {"ttft": 150.0})


def results():
    return {"disagg": [make_run(2.0, 50.0), make_run(math.inf, 80.0)],
            "colocated": [make_run(2.0, 60.0), make_run(math.inf, 120.0)],
            "hf": [make_run(math.inf, 500.0)]}


def test_table_has_a_row_per_system_and_rate():
    table = markdown_table(results()).splitlines()
    assert len(table) == 2 + 5
    assert table[-1].startswith("| hf | inf (offline) | 4 / 0 |")
    assert "| disagg | 2 | 4 / 0 | 2.00 | 1.50 | 8.0 |" in table[2]  # TTFT 50..200 ms: three meet 150 ms


def test_bars_prefer_the_inf_run():
    chosen = bar_runs(results())
    assert all(math.isinf(run.request_rate) for run, _ in chosen.values())
    assert bar_runs({"x": [make_run(2.0, 1.0)]})["x"][0].request_rate == 2.0


def test_write_outputs(tmp_path, capsys):
    args = argparse.Namespace(out=tmp_path, sweep=True)
    config = {"model": "m", "dtype": "float32", "device": "cpu", "num_prompts": 4, "input_len": 8,
              "output_len": 4, "max_concurrency": 2, "rates": [2.0, math.inf]}
    write_outputs(args, config, results())
    assert "| system |" in (tmp_path / "compare.md").read_text() and "| system |" in capsys.readouterr().out
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert set(doc["systems"]) == {"disagg", "colocated", "hf"} and doc["config"]["rates"] == [2.0, "inf"]
    for png in ("compare.png", "compare_sweep.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
