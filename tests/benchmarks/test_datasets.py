"""Random lengths follow vLLM's range ratio; ShareGPT takes the first human turn and sizes the reply."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.datasets import (
    MIN_RANDOM_TOKEN_ID,
    count_tokens,
    first_exchange,
    length_range,
    random_requests,
    sharegpt_requests,
    system_prompt_requests,
)
from tests.conftest import save_tiny_tokenizer


def test_random_lengths_stay_in_the_range_and_cover_it():
    reqs = random_requests(500, 100, 20, 0.5, vocab_size=300, seed=1)
    in_lens, out_lens = [r.prompt_len for r in reqs], [r.output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    assert min(in_lens) < 60 and max(in_lens) > 140  # uniform over the whole range, not a corner of it
    assert all(len(r.prompt) == r.prompt_len for r in reqs)
    assert all(MIN_RANDOM_TOKEN_ID <= t < 300 for r in reqs for t in r.prompt)


def test_random_ratio_zero_is_fixed_and_seeded():
    reqs = random_requests(10, 32, 8, 0.0, vocab_size=300, seed=2)
    assert {r.prompt_len for r in reqs} == {32} and {r.output_len for r in reqs} == {8}
    assert [r.prompt for r in reqs] == [r.prompt for r in random_requests(10, 32, 8, 0.0, vocab_size=300, seed=2)]
    assert len({tuple(r.prompt) for r in reqs}) == 10  # no shared prompts (no accidental prefix hits)


def test_length_range_matches_vllm():
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(10, 0.33) == (6, 14)  # floor / ceil
    assert length_range(1, 0.9) == (1, 2)  # never below 1
    with pytest.raises(ValueError):
        length_range(10, 1.0)


def test_random_text_for_chat(tmp_path):
    words = random_requests(3, 12, 4, 0.0, vocab_size=300, as_text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 12 for r in words)
    tok = save_tiny_tokenizer(tmp_path)
    decoded = random_requests(3, 12, 4, 0.0, vocab_size=256, as_text=True, tokenizer=tok)
    assert all(isinstance(r.prompt, str) and r.prompt for r in decoded)


def write_sharegpt(path):
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": "Hello there, how are you?"},
                                      {"from": "gpt", "value": "x" * 400}]},
        {"id": "b", "conversations": [{"from": "system", "value": "be nice"},
                                      {"from": "human", "value": "Second prompt"},
                                      {"from": "gpt", "value": "short"},
                                      {"from": "human", "value": "a later turn that is not used"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "no reply"}]},
        {"id": "d", "conversations": []},
        {"id": "e", "conversations": [{"from": "gpt", "value": "reply first"}, {"from": "human", "value": "?"}]},
    ]
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_takes_first_human_turn_and_skips_unusable(tmp_path):
    reqs = sharegpt_requests(write_sharegpt(tmp_path / "sg.json"), 10, seed=0)
    assert sorted(r.prompt for r in reqs) == ["Hello there, how are you?", "Second prompt"]
    by_prompt = {r.prompt: r for r in reqs}
    assert by_prompt["Hello there, how are you?"].output_len == 100  # 400 chars / 4
    assert by_prompt["Second prompt"].output_len == 1  # 5 chars / 4, at least 1
    assert by_prompt["Second prompt"].prompt_len == len("Second prompt") // 4


def test_sharegpt_cap_count_and_tokenizer(tmp_path):
    path = write_sharegpt(tmp_path / "sg.json")
    capped = sharegpt_requests(path, 10, output_len_cap=16)
    assert max(r.output_len for r in capped) == 16
    assert len(sharegpt_requests(path, 1)) == 1
    tok = save_tiny_tokenizer(tmp_path / "tok")  # byte-level: one token per byte
    exact = {r.prompt: r for r in sharegpt_requests(path, 10, tokenizer=tok)}
    assert exact["Second prompt"].prompt_len == len("Second prompt")
    assert exact["Hello there, how are you?"].output_len == 400
    assert count_tokens("abcdefgh") == 2


def test_first_exchange():
    assert first_exchange([{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]) == ("q", "a")
    assert first_exchange([{"from": "human", "value": "q"}]) is None


def test_system_prompt_requests_share_a_few_prefixes_and_are_seeded():
    reqs, which = system_prompt_requests(40, 3, 32, 8, 4, vocab_size=300, seed=5)
    again, which_again = system_prompt_requests(40, 3, 32, 8, 4, vocab_size=300, seed=5)
    assert [r.prompt for r in reqs] == [r.prompt for r in again] and which == which_again
    assert [r.prompt for r in reqs] != [r.prompt for r in system_prompt_requests(40, 3, 32, 8, 4, vocab_size=300,
                                                                                 seed=6)[0]]
    assert all(len(r.prompt) == r.prompt_len == 40 and r.output_len == 4 for r in reqs)
    systems = {k: tuple(r.prompt[:32]) for r, k in zip(reqs, which)}
    assert len(set(systems.values())) == 3 == len(set(which))  # one system prompt per index, all used
    assert all(tuple(r.prompt[:32]) == systems[k] for r, k in zip(reqs, which))
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 40  # every user suffix its own
    assert system_prompt_requests(7, 3, 8, 2, 1, vocab_size=300, dist="round-robin")[1] == [0, 1, 2, 0, 1, 2, 0]
    zipf = system_prompt_requests(600, 4, 8, 2, 1, vocab_size=300, dist="zipf")[1]
    assert zipf.count(0) > zipf.count(1) > zipf.count(3)  # weights 1, 1/2, 1/3, 1/4
    with pytest.raises(ValueError, match="distribution"):
        system_prompt_requests(1, 1, 8, 2, 1, vocab_size=300, dist="pareto")


def test_system_prompt_requests_as_chat_messages():
    reqs, which = system_prompt_requests(4, 2, 6, 3, 2, vocab_size=300, seed=1, as_text=True, dist="round-robin")
    assert [m["role"] for m in reqs[0].messages] == ["system", "user"]
    assert reqs[0].messages[0]["content"] == reqs[2].messages[0]["content"] != reqs[1].messages[0]["content"]
    assert len(reqs[0].messages[0]["content"].split()) == 6 and reqs[0].prompt.startswith(reqs[0].messages[0]["content"])
