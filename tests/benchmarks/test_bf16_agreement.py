"""benchmarks/bf16_agreement.py on a tiny random model: fp32 agrees everywhere, the scoring sees
altered tokens, bf16 runs end to end, and the CLI writes its JSON."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bf16_agreement
from tests.conftest import TINY_SHAPE

NUM_PROMPTS, MAX_TOKENS = 3, 8
SMALL = ["--num-prompts", str(NUM_PROMPTS), "--max-tokens", str(MAX_TOKENS), "--num-threads", "1"]


@pytest.mark.timeout(120)
def test_float32_engine_agrees_with_transformers_everywhere(tiny_llama, capsys):
    # text prompts through the tiny byte-level tokenizer: the default path
    result = bf16_agreement.measure(bf16_agreement.parse_args(["--model", str(tiny_llama), "--dtype", "float32",
                                                               "--transformers-baseline", *SMALL]))
    assert result["positions"] == NUM_PROMPTS * MAX_TOKENS
    assert result["agreement"] == 1.0 and result["agreements"] == result["positions"]
    assert result["agreement_or_tie"] == 1.0
    assert result["num_disagreements"] == 0 and result["disagreements"] == []
    assert result["requests_all_agree"] == NUM_PROMPTS and result["meets_target"]
    assert all(r["first_disagreement"] is None and r["agreement"] == 1.0 for r in result["requests"])
    assert [r["prompt_len"] for r in result["requests"]] == [len(t.encode()) for t in bf16_agreement.PROMPTS[:3]]
    # transformers' own incremental greedy, scored the same way: in fp32 it agrees with itself too
    base = result["transformers_baseline"]
    assert base["positions"] == NUM_PROMPTS * MAX_TOKENS and base["agreement"] == 1.0
    bf16_agreement.report(result)
    assert "baseline, transformers' own incremental greedy scored the same way: 100.00%" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_scoring_counts_altered_tokens_as_disagreements(tiny_llama):
    args = bf16_agreement.parse_args(["--model", str(tiny_llama), "--dtype", "float32", "--random-prompts", *SMALL])
    prompts = bf16_agreement.make_prompts(tiny_llama, NUM_PROMPTS, True, 0, TINY_SHAPE["vocab_size"])
    outputs = bf16_agreement.engine_generate(tiny_llama, prompts, args)
    model = bf16_agreement.load_transformers(tiny_llama, torch.float32)
    assert bf16_agreement.score(model, prompts, outputs)["agreement"] == 1.0

    # the last token of request 0 and 2 altered: no later position sees it, so exactly two disagree
    altered = [list(o) for o in outputs]
    for r in (0, 2):
        altered[r][-1] = (altered[r][-1] + 1) % TINY_SHAPE["vocab_size"]
    got = bf16_agreement.score(model, prompts, altered)
    assert got["agreements"] == got["positions"] - 2 and got["num_disagreements"] == 2
    assert [(d["request"], d["position"]) for d in got["disagreements"]] == [(0, MAX_TOKENS - 1), (2, MAX_TOKENS - 1)]
    for d in got["disagreements"]:
        assert d["engine_token"] == altered[d["request"]][-1] and d["transformers_token"] == outputs[d["request"]][-1]
        assert d["gap"] > 0
    assert [r["first_disagreement"] for r in got["requests"]] == [MAX_TOKENS - 1, None, MAX_TOKENS - 1]
    assert got["requests"][1]["agreement"] == 1.0
    assert got["requests"][0]["agreement"] == pytest.approx((MAX_TOKENS - 1) / MAX_TOKENS)

    # an early alteration: that position disagrees, and it is the first disagreement
    altered = [list(o) for o in outputs]
    altered[1][2] = (altered[1][2] + 7) % TINY_SHAPE["vocab_size"]
    got = bf16_agreement.score(model, prompts, altered)
    assert got["agreements"] < got["positions"] and got["requests"][1]["first_disagreement"] == 2
    assert got["disagreements"][0]["position"] == 2 and got["disagreements"][0]["engine_token"] == altered[1][2]


@pytest.mark.timeout(120)
def test_bfloat16_runs_end_to_end(tiny_llama, capsys):
    result = bf16_agreement.measure(bf16_agreement.parse_args(["--model", str(tiny_llama), "--random-prompts", *SMALL]))
    assert result["dtype"] == "bfloat16" and result["prompts"] == "random"
    assert result["positions"] == NUM_PROMPTS * MAX_TOKENS and len(result["requests"]) == NUM_PROMPTS
    assert 0.0 <= result["agreement"] <= result["agreement_or_tie"] <= 1.0
    assert result["agreements"] + result["num_disagreements"] == result["positions"]
    assert 0 <= result["exact_ties"] <= result["near_ties"] <= result["num_disagreements"]
    assert all(d["gap"] >= 0 for d in result["disagreements"])
    bf16_agreement.report(result)
    assert "top-1 agreement" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_cli_writes_the_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "agreement.json"
    assert bf16_agreement.main(["--model", str(tiny_llama), "--dtype", "float32", "--random-prompts", *SMALL,
                                "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["positions"] == NUM_PROMPTS * MAX_TOKENS and doc["agreement"] == 1.0
    assert doc["num_threads"] == 1 and "model_name" in doc["cpu"]
    printed = capsys.readouterr().out
    assert "CPU:" in printed and "top-1 agreement 100.00%" in printed


def test_ulp_is_the_dtype_spacing():
    assert bf16_agreement.ulp(1.5, torch.bfloat16) == 2.0**-7
    assert bf16_agreement.ulp(-12.0, torch.bfloat16) == 2.0**-4
    assert bf16_agreement.ulp(3.0, torch.float32) == 2.0**-22


@pytest.mark.timeout(120)
def test_fp32_reference_scores_both_sides_against_the_fp32_forward(tiny_llama, capsys):
    # fp32 engine: its tokens and transformers' forward both are the fp32 forward's argmax
    result = bf16_agreement.measure(bf16_agreement.parse_args(["--model", str(tiny_llama), "--dtype", "float32",
                                                               "--random-prompts", "--fp32-reference", *SMALL]))
    assert result["fp32_reference"] == {"engine_vs_fp32": 1.0, "transformers_bf16_vs_fp32": 1.0}
    bf16_agreement.report(result)
    assert "against the float32 forward on the same sequences: the engine 100.00%" in capsys.readouterr().out
    # altered engine tokens count against the engine only: transformers' argmax is taken on the same context
    args = bf16_agreement.parse_args(["--model", str(tiny_llama), "--dtype", "float32", "--random-prompts", *SMALL])
    prompts = bf16_agreement.make_prompts(tiny_llama, NUM_PROMPTS, True, 0, TINY_SHAPE["vocab_size"])
    outputs = bf16_agreement.engine_generate(tiny_llama, prompts, args)
    model = bf16_agreement.load_transformers(tiny_llama, torch.float32)
    assert bf16_agreement.forced_argmax(model, prompts, outputs) == outputs  # greedy: its own argmax everywhere
    altered = [list(o) for o in outputs]
    altered[0][-1] = (altered[0][-1] + 1) % TINY_SHAPE["vocab_size"]
    ref = bf16_agreement.fp32_reference(tiny_llama, bf16_agreement.score(model, prompts, altered), prompts, altered)
    assert ref["engine_vs_fp32"] == pytest.approx(1 - 1 / (NUM_PROMPTS * MAX_TOKENS))
    assert ref["transformers_bf16_vs_fp32"] == 1.0


def test_same_share_counts_equal_positions():
    assert bf16_agreement.same_share([[1, 2], [3]], [[1, 5], [3]]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        bf16_agreement.same_share([[1, 2]], [[1]])
