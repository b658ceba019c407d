"""Greedy outputs of the engine equal transformers' generate, token for token, in float32:
plain batches, chunked prefill, prefix-cache hits, preemption by recompute and by swap,
max_num_seqs below the number of prompts, and requests that arrive while others decode."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import assert_no_leak, save_tiny_model

MAX_TOKENS = 12


def make_prompts(n=12, vocab=256, lengths=(1, 2, 7, 16, 17, 33, 64, 100, 150, 200, 257, 300), seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def hf_greedy(model, prompts, max_tokens=MAX_TOKENS):
    """transformers' own greedy generate, one prompt at a time (no padding)."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_tokens, min_new_tokens=0,
                                 pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", pytest.param("smollm2", marks=pytest.mark.slow)])
def tiny(request, tmp_path_factory):
    """(model folder, 12 prompts of 1..300 tokens, transformers' greedy outputs) for tiny random
    models of each architecture, and for the default model (slow tier)."""
    if request.param == "smollm2":
        from transformers import AutoModelForCausalLM

        from pdserve.engine.loader import resolve_model

        path = resolve_model("smollm2")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        prompts = make_prompts(vocab=model.config.vocab_size)
    else:
        path = tmp_path_factory.mktemp(f"tiny-{request.param}")
        model = save_tiny_model(path, request.param)
        prompts = make_prompts()
    return path, prompts, hf_greedy(model, prompts)


def make_llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_threads", 2)
    if Path(path).name.startswith("tiny-"):  # ~512 bytes a token: the default 2 GB pool is waste
        kw.setdefault("kv_cache_memory_gb", 0.05)
    return LLM(str(path), **kw)


def generate_greedy(llm, prompts, max_tokens=MAX_TOKENS):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))]


def check(llm, prompts, expected):
    got = generate_greedy(llm, prompts)
    mismatches = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert not mismatches, f"prompts {mismatches} differ: {[(got[i], expected[i]) for i in mismatches[:2]]}"
    assert_no_leak(llm.engine.block_manager)


def test_plain_batch_matches_transformers(tiny):
    path, prompts, expected = tiny
    check(make_llm(path), prompts, expected)


def test_chunked_prefill_matches(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path, max_num_batched_tokens=64)  # smaller than the longest prompts: chunked
    check(llm, prompts, expected)


def test_prefix_cache_hits_match(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path, block_size=16)
    shared = prompts[10][:120]  # > one block
    variants = [shared + p[:20] for p in prompts[:4]]
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    want = hf_greedy(model, variants)
    check(llm, variants[:1], want[:1])  # warms the cache
    queries = llm.engine.block_manager.num_prefix_hits
    check(llm, variants[1:], want[1:])
    assert llm.engine.block_manager.num_prefix_hits - queries >= 3 * 112  # 7 shared blocks each
    check(llm, prompts, expected)


@pytest.mark.parametrize("swap", [0.0, 0.01])
def test_preemption_matches(tiny, swap):
    path, prompts, expected = tiny
    # 24 blocks of 16 tokens: the short prompts fill the pool, then their growth forces preemption.
    llm = make_llm(path, num_kv_blocks=24, block_size=16, swap_space_gb=swap)
    check(llm, prompts, expected)
    assert llm.engine.scheduler.num_preemptions > 0
    if swap:
        assert llm.engine.block_manager.num_host_blocks > 0


def test_max_num_seqs_smaller_than_prompts(tiny):
    path, prompts, expected = tiny
    check(make_llm(path, max_num_seqs=3), prompts, expected)


def test_requests_added_while_others_decode(tiny):
    path, prompts, expected = tiny
    llm = make_llm(path)
    engine = llm.engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    results = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        if pending:  # a new request every other step
            i, p = pending.pop(0)
            engine.add_request(p, params, request_id=str(i))
        for out in engine.step():
            results[int(out.request_id)] = out.token_ids
        if pending:
            for out in engine.step():
                results[int(out.request_id)] = out.token_ids
    assert [results[i] for i in range(len(prompts))] == expected
    assert_no_leak(engine.block_manager)
