"""`pdserve bench serve` against a real tiny-model stack (router + prefill + decode processes)."""

from __future__ import annotations

import json

import pytest

from benchmarks.harness.stack import Stack
from pdserve.bench.cli import main
from tests.conftest import save_tiny_model, save_tiny_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "tiny"
    save_tiny_model(path, "llama")
    save_tiny_tokenizer(path)
    return path


def bench(capsys, pytestconfig, stack_kw: dict, *runs: list[str]) -> tuple[list[int], list[dict], str]:
    """Start a stack, run `pdserve bench serve` once per argv (--base-url added), and return the
    exit codes, every node's status once idle, and the printed output (the assertions show it when
    they fail; `-s` prints it too)."""
    # The tiny model needs ~512 bytes of KV a token: a small pool, not the default 2 GB per node.
    stack = Stack(**{**stack_kw, "extra": ["--kv-cache-memory-gb", "0.1", *stack_kw.get("extra", [])]})
    try:
        codes = [main(["serve", "--base-url", stack.url, *argv]) for argv in runs]
        idle = stack.wait_idle()
    finally:
        stack.close()
    out = capsys.readouterr().out
    if pytestconfig.getoption("capture") == "no":
        with capsys.disabled():
            print("\n" + out)
    return codes, idle, out


def test_bench_serve_against_a_real_stack(tmp_path, model_dir, capsys, pytestconfig):
    codes, idle, out = bench(
        capsys, pytestconfig, {"model": str(model_dir)},
        ["--num-prompts", "8", "--random-input-len", "32", "--random-output-len", "8", "--random-range-ratio", "0.25",
         "--random-vocab-size", "256", "--max-concurrency", "4", "--num-warmups", "1", "--return-token-ids",
         "--disable-tqdm", "--goodput", "ttft:60000", "--save-json", str(tmp_path / "r.json"), "--plot", str(tmp_path)],
        ["--endpoint", "/v1/chat/completions", "--tokenizer", str(model_dir), "--num-prompts", "4",
         "--random-input-len", "16", "--random-output-len", "4", "--request-rate", "20", "--disable-tqdm",
         "--save-json", str(tmp_path / "chat.json")])
    assert codes == [0, 0], out
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


def test_bench_serve_chaos_kills_nodes_and_accounts_for_every_request(tmp_path, model_dir, capsys, pytestconfig):
    """--chaos-interval kills decode nodes mid-run; `pdserve serve` restarts them; every request
    either completes (re-dispatched by the router) or is reported with its error."""
    stack_kw = {"model": str(model_dir), "num_decode": 2, "decode_args": "--step-delay-s 0.05",
                "extra": ["--router-args", "--heartbeat-timeout 1.5"]}
    codes, idle, out = bench(
        capsys, pytestconfig, stack_kw,
        ["--num-prompts", "40", "--random-input-len", "32", "--random-output-len", "48", "--random-vocab-size", "256",
         "--max-concurrency", "16", "--disable-tqdm", "--chaos-interval", "3", "--chaos-roles", "decode",
         "--chaos-max-faults", "2", "--save-json", str(tmp_path / "chaos.json")])
    assert codes == [0], out
    (run,) = json.loads((tmp_path / "chaos.json").read_text())["runs"]
    assert run["chaos"]["events"] and run["chaos"]["router_retries"] >= 1
    requests = run["requests"]
    assert len(requests) == 40 and all(r["success"] or r["error"] for r in requests)  # each accounted for
    # Two kills 3 s apart: the second may hit the last decode node while the first restarts; the
    # router parks the requests in flight until a node is back, so none of them is lost. A request
    # arriving while no decode node is ready is refused at once (503), which is explicit too.
    assert len(run["chaos"]["events"]) == 2, out
    assert all(r["success"] or r["error"].startswith("HTTP 503") for r in requests), out
    assert "faults injected" in out and "requests completed" in out
    assert all(s["num_used_blocks"] == 0 for s in idle)


@pytest.mark.timeout(60)
def test_a_stack_that_exits_at_once_says_so(tmp_path):
    # a model folder that does not exist: `pdserve serve` refuses it before starting anything
    with pytest.raises(RuntimeError, match=r"the stack exited after \d+ s without becoming ready"):
        Stack(str(tmp_path / "no-such-model"), timeout=50)
