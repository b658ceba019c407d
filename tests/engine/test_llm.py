"""The offline API's behaviour beyond greedy parity: seeded sampling, stop conditions, logprobs,
priorities, text handling and bad input, on a tiny random model with a byte-level tokenizer."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import assert_no_leak, save_tiny_model

PROMPTS = [[5, 6, 7, 8], list(range(10, 60)), [99] * 20, list(range(100, 103))]


# The default 2 GB pool would be touched page by page; the tiny model needs ~512 bytes a token.
SMALL_POOL_GB = 0.05


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_threads=2, block_size=8, kv_cache_memory_gb=SMALL_POOL_GB)


def sampled(llm, prompts, **kw):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, **kw), use_tqdm=False)]


def test_same_seed_same_tokens_whatever_the_batch(llm):
    alone = sampled(llm, PROMPTS[:1], temperature=1.0, seed=42)[0]
    in_batch = sampled(llm, PROMPTS[1:3] + PROMPTS[:1], temperature=1.0, seed=42)[2]
    assert alone == in_batch
    other_seed = sampled(llm, PROMPTS[:1], temperature=1.0, seed=43)[0]
    assert other_seed != alone
    assert_no_leak(llm.engine.block_manager)


def test_seeded_sampling_survives_preemption(tiny_llama, llm):
    want = sampled(llm, PROMPTS, temperature=0.8, top_p=0.9, seed=7)
    tight = LLM(str(tiny_llama), dtype="float32", num_threads=2, block_size=8, num_kv_blocks=12)
    assert sampled(tight, PROMPTS, temperature=0.8, top_p=0.9, seed=7) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert_no_leak(tight.engine.block_manager)


def test_stop_token_ids_end_the_output_and_are_kept(llm):
    full = sampled(llm, PROMPTS[:1], temperature=0, ignore_eos=True)[0]
    stop_at = full[5]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.token_ids == full[: full.index(stop_at) + 1]
    assert out.finish_reason == "stop"


def test_eos_ends_the_output_unless_ignored(llm):
    eos = 257
    # Find a prompt whose greedy continuation reaches EOS within 64 tokens, if the random model has one.
    outs = llm.generate([[i, i + 1] for i in range(3, 60)], SamplingParams(max_tokens=64, temperature=0),
                        use_tqdm=False)
    stopped = [o for o in outs if o.finish_reason == "stop"]
    for o in stopped:
        assert o.token_ids[-1] == eos and eos not in o.token_ids[:-1]
    for o in outs:
        if o.finish_reason == "length":
            assert len(o.token_ids) == 64 and eos not in o.token_ids
    if stopped:
        again = llm.generate([stopped[0].prompt_token_ids], SamplingParams(max_tokens=64, temperature=0,
                                                                           ignore_eos=True), use_tqdm=False)[0]
        assert len(again.token_ids) == 64 and again.token_ids[: len(stopped[0].token_ids)] == stopped[0].token_ids


def test_stop_strings_cut_the_text(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert full.text and full.finish_reason == "length"
    stop = full.text[4:6]
    if not stop.strip() or stop in full.text[:4]:
        stop = full.text[4:7]
    cut = llm.generate(["Hello"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert_no_leak(llm.engine.block_manager)


def test_logprobs_hold_top_n_and_the_sampled_token(llm, tiny_llama):
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=1.0, seed=3, logprobs=3),
                       use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs):
        assert token in lp and 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
    # The first token's logprobs are the model's raw distribution after the prompt.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPTS[0]])).logits[0, -1].float(), -1)
    for tok, v in out.logprobs[0].items():
        assert v == pytest.approx(ref[tok].item(), abs=1e-4)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].logprobs is None


def test_priority_orders_admission(llm, tiny_llama):
    solo = LLM(str(tiny_llama), dtype="float32", num_threads=2, max_num_seqs=1, kv_cache_memory_gb=SMALL_POOL_GB,
               scheduling_policy="priority")
    engine = solo.engine
    for rid, prio in (("late", 3), ("first", -5), ("mid", 0)):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, temperature=0), request_id=rid, priority=prio)
    order = []
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step()]
    assert order == ["first", "mid", "late"]
    outs = solo.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2), priority=[1, 0], use_tqdm=False)
    assert len(outs) == 2 and all(o.finished for o in outs)


def test_text_prompts_and_chat(llm):
    out = llm.generate("Hi there", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert out.prompt == "Hi there" and len(out.token_ids) <= 5
    assert out.prompt_token_ids == llm.tokenizer.encode("Hi there")


def test_bad_input_is_refused_and_leaves_nothing_behind(llm):
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate([[1, 2, 999999]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 5000], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="2 values for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()], use_tqdm=False)
    # A batch whose third prompt is bad: the first two were added, and must be gone again.
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [3, 4], [1, -1]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert_no_leak(llm.engine.block_manager)
    assert sampled(llm, PROMPTS[:1], temperature=0)  # still serves


def test_a_model_without_tokenizer_takes_token_ids_only(tmp_path):
    save_tiny_model(tmp_path, "llama")
    bare = LLM(str(tmp_path), dtype="float32", num_threads=2, kv_cache_memory_gb=SMALL_POOL_GB)
    assert bare.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        bare.generate(["text"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_unknown_model_gets_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a local model directory"):
        LLM("meta-llama/Llama-3-8B")


def test_incremental_detokenizer_handles_multibyte_characters(llm):
    tok = llm.tokenizer
    text = "héllo wörld 日本語 ✓ done"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # bytes: multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tok, [65, 66])
    pieces = [detok.add_tokens([t]) for t in ids]
    assert "".join(pieces) == text == detok.text
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_detokenizer_stop_string_across_tokens(llm):
    tok = llm.tokenizer
    detok = IncrementalDetokenizer(tok, [65], stop=["wör"])
    out = "".join(detok.add_tokens([t]) for t in tok.encode("héllo wörld"))
    assert detok.stopped and out == detok.text == "héllo "


def test_streamed_pieces_hold_back_a_possible_stop_string(llm):
    tok = llm.tokenizer
    detok = IncrementalDetokenizer(tok, [65], stop=["xyz"])
    pieces = [detok.add_tokens([t]) for t in tok.encode("abc xy")]
    assert "".join(pieces) == "abc "  # "xy" may still become "xyz"
    assert detok.add_tokens(tok.encode("!"), final=True) == "xy!"
