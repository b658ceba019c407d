"""`pdserve bench serve` against a real tiny-model stack (router + prefill + decode processes)."""

from __future__ import annotations

import json

import pytest

from benchmarks.bench_cli import main
from tests.conftest import save_tiny_model, save_tiny_tokenizer
from tests.e2e.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_serve_against_a_real_stack(tmp_path, capsys):
    model_dir = tmp_path / "tiny"
    save_tiny_model(model_dir, "llama")
    save_tiny_tokenizer(model_dir)
    stack = Stack(str(model_dir))
    try:
        code = main(["serve", "--base-url", stack.url, "--num-prompts", "8", "--random-input-len", "32",
                     "--random-output-len", "8", "--random-range-ratio", "0.25", "--random-vocab-size", "256",
                     "--max-concurrency", "4", "--num-warmups", "1", "--return-token-ids", "--disable-tqdm",
                     "--goodput", "ttft:60000", "--save-json", str(tmp_path / "r.json"), "--plot", str(tmp_path)])
        chat = main(["serve", "--base-url", stack.url, "--endpoint", "/v1/chat/completions", "--tokenizer",
                     str(model_dir), "--num-prompts", "4", "--random-input-len", "16", "--random-output-len", "4",
                     "--request-rate", "20", "--disable-tqdm", "--save-json", str(tmp_path / "chat.json")])
        idle = stack.wait_idle()
    finally:
        stack.close()
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert code == 0 and chat == 0, out
    (run,) = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert run["summary"]["completed"] == 8 and run["summary"]["failed"] == 0
    assert run["summary"]["num_good"] == 8
    for r in run["requests"]:  # ignore_eos: exactly max_tokens each; usage gives the true prompt length
        assert r["output_len"] == r["max_tokens"] and 24 <= r["prompt_len"] <= 40 and r["ttft_s"] > 0
    assert run["summary"]["total_output_tokens"] == sum(r["max_tokens"] for r in run["requests"])
    (chat_run,) = json.loads((tmp_path / "chat.json").read_text())["runs"]
    assert chat_run["summary"]["completed"] == 4 and chat_run["summary"]["total_output_tokens"] == 16
    assert (tmp_path / "ttft_cdf.png").is_file() and "Successful requests:" in out
    assert all(s["num_used_blocks"] == 0 for s in idle)
