"""`pdserve bench serve` end to end against the fake server: the printed table, the JSON file's
schema, the PNGs, a sweep, and Ctrl-C printing the partial summary."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.bench.cli import main
from pdserve.bench.report import SCHEMA
from tests.benchmarks.fake_openai import MODEL
from tests.benchmarks.test_datasets import write_sharegpt

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "request_goodput",
                "num_good", "slos_ms", "percentiles", "errors",
                *(f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p50", "p90", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el"))}
RECORD_KEYS = {"request_id", "prompt_len", "max_tokens", "success", "error", "start_s", "ttft_s", "itl_s",
               "e2el_s", "tpot_s", "output_len", "generated_text", "cached_tokens", "conversation", "turn"}


def bench(fake, *flags: str) -> int:
    fake.ttft_s, fake.itl_s = 0.01, 0.002
    return main(["serve", "--base-url", fake.url, "--num-prompts", "6", "--random-input-len", "8",
                 "--random-output-len", "4", "--disable-tqdm", *flags])


def test_prints_the_table_and_saves_json(fake, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench(fake, "--save-json", str(out), "--goodput", "ttft:5000", "tpot:1000", "--request-rate", "50") == 0
    text = capsys.readouterr().out
    for line in ("Successful requests:", "Request goodput (req/s)", "Output token throughput (tok/s):",
                 "Median TTFT (ms):", "P90 TPOT (ms):", "P99 ITL (ms):", "Mean E2EL (ms):"):
        assert line in text, text
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA and doc["config"]["model"] == MODEL  # the first id of /v1/models
    assert doc["config"]["request_rate"] == 50.0 and doc["config"]["ignore_eos"] is True
    (run_,) = doc["runs"]
    assert run_["request_rate"] == "50" and run_["interrupted"] is False
    assert set(run_["summary"]) == SUMMARY_KEYS
    assert run_["summary"]["completed"] == 6 and run_["summary"]["num_good"] == 6
    assert run_["summary"]["total_output_tokens"] == 24
    assert [r["request_id"] for r in run_["requests"]] == list(range(6))
    assert all(set(r) == RECORD_KEYS and len(r["itl_s"]) == 3 for r in run_["requests"])
    assert all(b["max_tokens"] == 4 and b["model"] == MODEL for b in fake.bodies)


@pytest.mark.parametrize("send_token_ids", [True, False], ids=["token_ids", "usage_only"])
def test_itl_counts_tokens_when_chunks_carry_several(fake, tmp_path, capsys, send_token_ids):
    """Four tokens to a chunk: with default flags the mean ITL is the TPOT (per token), not four
    times it, whether the server returns token ids or only the final usage."""
    fake.ttft_s, fake.itl_s, fake.tokens_per_chunk, fake.send_token_ids = 0.02, 0.02, 4, send_token_ids
    out = tmp_path / "itl.json"
    assert main(["serve", "--base-url", fake.url, "--num-prompts", "4", "--random-input-len", "8",
                 "--random-output-len", "25", "--max-concurrency", "4", "--disable-tqdm", "--save-json", str(out)]) == 0
    capsys.readouterr()
    (run_,) = json.loads(out.read_text())["runs"]
    summary = run_["summary"]
    assert summary["total_output_tokens"] == 100
    assert all(len(r["itl_s"]) == 24 for r in run_["requests"])  # one per token after the first
    assert summary["mean_itl_ms"] == pytest.approx(summary["mean_tpot_ms"], rel=0.10), summary
    assert all(b["return_token_ids"] is True for b in fake.bodies)


def test_plot_writes_cdf_pngs(fake, tmp_path):
    assert bench(fake, "--plot", str(tmp_path / "plots"), "--percentiles", "50,99") == 0
    for name in ("ttft", "tpot", "itl", "e2el"):
        png = tmp_path / "plots" / f"{name}_cdf.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_which_extra_before_sending(fake, tmp_path, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(SystemExit, match=r"pip install 'pdserve\[bench\]'"):
        bench(fake, "--plot", str(tmp_path / "plots"))
    assert fake.bodies == [] and not (tmp_path / "plots").exists()


def test_sweep_runs_each_rate_and_plots(fake, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert bench(fake, "--sweep", "20,inf", "--plot", str(tmp_path), "--save-json", str(out), "--slo", "ttft:5000") == 0
    assert [r["request_rate"] for r in json.loads(out.read_text())["runs"]] == ["20", "inf"]
    assert "| rate (req/s) |" in capsys.readouterr().out
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_sharegpt_on_the_chat_endpoint(fake, tmp_path):
    path = write_sharegpt(tmp_path / "sg.json")
    code = bench(fake, "--dataset-name", "sharegpt", "--dataset-path", str(path), "--endpoint",
                 "/v1/chat/completions", "--sharegpt-output-len", "5", "--model", MODEL)
    assert code == 0
    assert {b["messages"][0]["content"] for b in fake.bodies} == {"Hello there, how are you?", "Second prompt"}
    assert all("ignore_eos" not in b and b["max_tokens"] <= 5 for b in fake.bodies)


def test_failed_requests_are_counted_not_fatal(fake, tmp_path, capsys):
    # random ids below 10 never occur, so make every prompt start with the fail switch via --extra-body
    code = bench(fake, "--extra-body", json.dumps({"prompt": [7, 1]}), "--save-json", str(tmp_path / "f.json"))
    assert code == 0
    summary = json.loads((tmp_path / "f.json").read_text())["runs"][0]["summary"]
    assert summary["completed"] == 0 and summary["failed"] == 6
    assert "error x6: HTTP 500" in capsys.readouterr().out


def test_bad_flags_and_unreachable_server_exit_2(fake, capsys):
    assert main(["serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert bench(fake, "--goodput", "latency:3") == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--think-time", "1"], "--think-time: only with --dataset-name conversation"),
    (["--num-conversations", "3", "--conversation-turns", "2"],
     "--num-conversations, --conversation-turns: only with --dataset-name conversation"),
    (["--dataset-name", "system-prompt", "--conversation-new-tokens", "9"],
     "--conversation-new-tokens: only with --dataset-name conversation"),
    (["--system-prompt-len", "64"], "--system-prompt-len: only with --dataset-name system-prompt"),
    (["--dataset-name", "conversation", "--num-system-prompts", "2"],
     "--num-system-prompts: only with --dataset-name system-prompt"),
    (["--oracle-cache-blocks", "100"], "--oracle-cache-blocks: only with --dataset-name conversation or system-prompt"),
    (["--dataset-name", "conversation", "--num-prompts", "5"], "--num-prompts does not apply to --dataset-name conversation"),
    (["--dataset-name", "conversation", "--random-input-len", "5"],
     "--random-input-len does not apply to --dataset-name conversation"),
    (["--dataset-name", "conversation", "--think-time", "-1"], "--think-time must be a number of seconds >= 0"),
    (["--dataset-name", "conversation", "--conversation-turns", "0"], "--conversation-turns must be >= 1, got 0"),
    (["--dataset-name", "system-prompt", "--num-system-prompts", "0"], "--num-system-prompts must be >= 1, got 0"),
    (["--dataset-name", "system-prompt", "--oracle-block-size", "0"], "--oracle-block-size must be >= 1, got 0"),
    (["--dataset-name", "conversation", "--goodput-search", "--goodput", "ttft:1", "tpot:1"],
     "--goodput-search is not supported with --dataset-name conversation"),
    (["--dataset-name", "conversation", "--chaos-interval", "1"],
     "--chaos-interval is not supported with --dataset-name conversation"),
])
def test_prefix_workload_flags_fail_in_one_line(fake, capsys, flags, message):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--base-url", fake.url, "--disable-tqdm", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("pdserve bench: error:"), err
    assert fake.bodies == []


def test_dataset_defaults_depend_on_the_dataset(fake, tmp_path):
    out = tmp_path / "d.json"
    assert main(["serve", "--base-url", fake.url, "--disable-tqdm", "--dataset-name", "system-prompt",
                 "--num-prompts", "2", "--system-prompt-len", "16", "--random-output-len", "2",
                 "--save-json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["random_input_len"] == 128 and config["num_system_prompts"] == 4
    assert config["system_prompt_dist"] == "uniform" and config["oracle_block_size"] == 16
    assert config["num_conversations"] is None and config["think_time"] is None
    assert [len(b["prompt"]) for b in fake.bodies] == [16 + 128] * 2


def test_ctrl_c_prints_the_partial_summary(fake, tmp_path):
    fake.ttft_s, fake.itl_s = 0.01, 0.01
    cmd = [sys.executable, "-m", "pdserve.bench.cli", "serve", "--base-url", fake.url, "--num-prompts", "200",
           "--request-rate", "20", "--random-input-len", "4", "--random-output-len", "2", "--disable-tqdm",
           "--save-json", str(tmp_path / "partial.json")]
    # A shell's background job starts with SIGINT ignored, and Python keeps that: give the child
    # the default disposition so that it installs its KeyboardInterrupt handler, as in a terminal.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:  # the header: the run is about to start (bounded, so a child that hangs fails the test)
        assert select.select([proc.stdout], [], [], 60)[0], "no header within 60 s"
        assert "prompts=200" in proc.stdout.readline()
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "interrupted: partial results" in out and "Traceback" not in out
    summary = json.loads((tmp_path / "partial.json").read_text())["runs"][0]["summary"]
    assert 0 < summary["completed"] < 200
