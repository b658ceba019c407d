"""The bimodal workload (shortest-job-first's): its classes, `pdserve bench serve --dataset-name
bimodal` against a fake server, E2E split by class, and benchmarks/sjf.py's report from hand-built
runs and, slow, on two tiny stacks."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.sjf import write_outputs
from pdserve.bench.by_length import by_length_table, e2e_by_output_len
from pdserve.bench.cli import main
from pdserve.bench.datasets import bimodal_requests, parse_output_lens
from pdserve.bench.runner import BenchmarkRun
from tests.benchmarks.conftest import make_record


def test_bimodal_draws_the_two_classes_in_proportion_and_is_seeded():
    reqs = bimodal_requests(2000, 32, (16, 512), 0.2, vocab_size=300, seed=3)
    lens = [r.output_len for r in reqs]
    assert set(lens) == {16, 512}
    assert 0.17 < lens.count(512) / len(lens) < 0.23
    assert all(r.prompt_len == len(r.prompt) == 32 for r in reqs)
    again = bimodal_requests(2000, 32, (16, 512), 0.2, vocab_size=300, seed=3)
    assert [(r.prompt, r.output_len) for r in again] == [(r.prompt, r.output_len) for r in reqs]
    assert {r.output_len for r in bimodal_requests(50, 8, (4, 9), 0.0, vocab_size=300)} == {4}
    assert {r.output_len for r in bimodal_requests(50, 8, (4, 9), 1.0, vocab_size=300)} == {9}


@pytest.mark.parametrize(("lens", "fraction", "message"), [
    ((16, 16), 0.2, "0 < SHORT < LONG, got 16,16"),
    ((0, 16), 0.2, "0 < SHORT < LONG, got 0,16"),
    ((16, 512), 1.5, "long fraction must be in [0, 1], got 1.5"),
])
def test_bimodal_refuses_bad_shapes(lens, fraction, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        bimodal_requests(4, 8, lens, fraction, vocab_size=300)


def test_output_lens_parse():
    assert parse_output_lens("16,512") == (16, 512)
    with pytest.raises(ValueError, match="SHORT,LONG"):
        parse_output_lens("16")


def test_e2e_by_output_len_splits_the_classes():
    records = [make_record(i, ttft_ms=10.0 * (i + 1)) for i in range(4)]  # max_tokens 1, E2E 10..40 ms
    records += [make_record(9, ttft_ms=100.0, itl_ms=[100.0, 100.0])]  # max_tokens 3, E2E 300 ms
    records += [make_record(10, ttft_ms=5.0, itl_ms=[1.0, 1.0], success=False)]  # failed: not counted
    stats = e2e_by_output_len(records)
    assert list(stats) == ["all", "max_tokens=1", "max_tokens=3"]
    assert stats["max_tokens=1"]["count"] == 4 and stats["max_tokens=1"]["mean_e2el_ms"] == pytest.approx(25.0)
    assert stats["max_tokens=3"]["count"] == 1 and stats["max_tokens=3"]["p99_e2el_ms"] == pytest.approx(300.0)
    assert stats["all"]["count"] == 5 and stats["all"]["p50_e2el_ms"] == pytest.approx(30.0)
    table = by_length_table({"fcfs": records}).splitlines()
    assert table[2:] == ["| fcfs | all | 5 | 80 | 30 | 290 |", "| fcfs | max_tokens=1 | 4 | 25 | 25 | 40 |",
                         "| fcfs | max_tokens=3 | 1 | 300 | 300 | 300 |"]


def test_bench_serve_bimodal_asks_for_both_lengths_and_prints_the_split(fake, capsys):
    fake.ttft_s, fake.itl_s = 0.005, 0.001
    assert main(["serve", "--base-url", fake.url, "--dataset-name", "bimodal", "--num-prompts", "20",
                 "--random-input-len", "8", "--bimodal-output-lens", "2,6", "--bimodal-long-fraction", "0.5",
                 "--disable-tqdm"]) == 0
    asked = [b["max_tokens"] for b in fake.bodies]
    assert set(asked) == {2, 6} and all(b["ignore_eos"] for b in fake.bodies)
    out = capsys.readouterr().out
    assert "| rate inf | max_tokens=2 |" in out and "| rate inf | max_tokens=6 |" in out


def test_bench_serve_bimodal_bad_lengths_exit_2(fake, capsys):
    assert main(["serve", "--base-url", fake.url, "--dataset-name", "bimodal", "--bimodal-output-lens", "512,16",
                 "--disable-tqdm"]) == 2
    assert "0 < SHORT < LONG" in capsys.readouterr().err


def test_sjf_report_from_hand_built_runs(tmp_path, capsys):
    import argparse

    from benchmarks.sjf import build_parser

    args: argparse.Namespace = build_parser().parse_args(["--out", str(tmp_path), "--model", "m"])
    def runs(fcfs_ms: float, sjf_ms: float) -> dict:
        return {p: BenchmarkRun(start=0.0, end=2.0, records=[make_record(i, ttft_ms=ms * (i + 1)) for i in range(3)])
                for p, ms in (("fcfs", fcfs_ms), ("sjf", sjf_ms))}

    # two rounds: SJF at half of FCFS, then at 0.8 of it
    write_outputs(args, 4.0, [runs(100.0, 50.0), runs(100.0, 80.0)])
    text = (tmp_path / "sjf.md").read_text()
    # pooled over the rounds: FCFS 200 ms mean both times, SJF 100 then 160
    assert "| fcfs | all | 6 | 200 | 200 |" in text and "| sjf | max_tokens=1 | 6 | 130 | 125 |" in text
    assert "| 1 | fcfs, sjf | sjf / fcfs | 0.20 / 0.20 | 0.10 / 0.10 | 0.500 | 0.500 |" in text
    assert "| median of 2 | | sjf / fcfs | | | **0.650** | **0.650** |" in text
    doc = json.loads((tmp_path / "sjf.json").read_text())
    assert doc["config"]["request_rate"] == 4.0
    assert doc["rounds"][0]["sjf"]["e2e_by_output_len"]["all"]["mean_e2el_ms"] == pytest.approx(100.0)
    assert doc["pooled"]["sjf"]["all"]["mean_e2el_ms"] == pytest.approx(130.0)
    assert [r["mean_ratio"] for r in doc["ratios"]] == pytest.approx([0.5, 0.8])
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_sjf_benchmark_runs_both_policies_on_tiny_stacks(tmp_path):
    import subprocess

    from benchmarks.harness.stack import child_env
    from tests.conftest import save_tiny_model, save_tiny_tokenizer

    model = tmp_path / "model"
    save_tiny_model(model, "llama")
    save_tiny_tokenizer(model)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.sjf", "--model", str(model), "--num-prompts", "16", "--input-len", "8",
         "--output-lens", "4,32", "--rounds", "2", "--calibration-prompts", "8", "--decode-args", "--max-num-seqs 2",
         "--sjf-aging-s", "5", "--num-warmups", "1", "--out", str(out)],
        env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads((out / "sjf.json").read_text())
    assert [list(r) for r in doc["rounds"]] == [["fcfs", "sjf"], ["sjf", "fcfs"]]  # the order alternates
    for runs in doc["rounds"]:
        for policy in ("fcfs", "sjf"):
            summary = runs[policy]["summary"]
            assert summary["completed"] == 16 and summary["failed"] == 0
            assert set(runs[policy]["e2e_by_output_len"]) == {"all", "max_tokens=4", "max_tokens=32"}
    assert len(doc["ratios"]) == 2 and "steady TPOT" in (out / "sjf.md").read_text()
