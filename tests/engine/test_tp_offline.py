"""Offline parity of tensor parallelism: in float32 on the CPU (gloo), TP 2 gives TP 1's tokens,
token for token, for tiny random Llama and Qwen2 models with KV heads split (2) and replicated (1),
tied and untied embeddings and an odd vocab; through chunked prefill, prefix-cache hits, n > 1
copy-on-write, preemption by recompute and by swap, and seeded sampling. Every rank's KV pool, as
the node process maps it, holds exactly TP 1's KV of the rank's heads. Slow: each TP 2 engine
starts a worker process."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import assert_no_leak, save_tiny_model, save_tiny_tokenizer
from tests.engine.tp_helpers import MODELS, make_model, tp_worker_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [[5, 6, 7, 8], list(range(10, 60)), [99] * 20, list(range(100, 103))]
SHARED = list(range(30, 62))  # 4 full blocks of 8: the second prompt hits them in the prefix cache
# max_num_batched_tokens 32: the 50-token prompt is prefilled in chunks.
# num_kv_blocks fixed: with one KV head replicated a TP 2 block costs twice TP 1's bytes, and the
# pools must have the same blocks for the KV comparison.
OPTIONS = dict(dtype="float32", block_size=8, max_num_batched_tokens=32, num_kv_blocks=256, skip_tokenizer_init=True)
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
FORKED = SamplingParams(max_tokens=10, temperature=1.0, seed=3, n=2, ignore_eos=True)  # shared blocks, copy-on-write


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-models")
    return {name: make_model(root, name) for name in MODELS}


@pytest.fixture(scope="module")
def reference(models):
    """TP 1's outputs and final KV pool, per model."""
    refs = {}
    for name, path in models.items():
        with LLM(str(path), **OPTIONS) as llm:
            refs[name] = (run_all(llm), llm.engine.runner.kv_buffer.clone())
    return refs


def tokens(outs) -> list[list[int]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


def run_all(llm: LLM, *, scenarios=("greedy", "prefix", "seeded", "forked")) -> dict:
    results = {}
    if "greedy" in scenarios:
        results["greedy"] = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    if "prefix" in scenarios:
        first = llm.generate([SHARED + [1, 2, 3]], GREEDY, use_tqdm=False)
        second = llm.generate([SHARED + [4, 5]], GREEDY, use_tqdm=False)
        assert second[0].num_cached_tokens >= len(SHARED)  # a prefix-cache hit
        results["prefix"] = tokens(first + second)
    if "seeded" in scenarios:
        results["seeded"] = tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
    if "forked" in scenarios:
        results["forked"] = tokens(llm.generate(PROMPTS[:2], FORKED, use_tqdm=False))
    assert_no_leak(llm.engine.block_manager)
    return results


@pytest.mark.parametrize("name", list(MODELS))
def test_tp2_gives_tp1_tokens_and_kv(name, models, reference):
    want, want_pool = reference[name]
    with LLM(str(models[name]), tensor_parallel_size=2, **OPTIONS) as llm:
        assert run_all(llm) == want
        runner = llm.engine.runner
        assert len(runner.kv_shards) == 2 and runner.kv_buffer is runner.kv_shards[0].tensor
        for shard in runner.kv_shards:  # every rank's pool, mapped in this process
            assert shard.shm is not None
            heads = want_pool[:, :, :, :, shard.head_start : shard.head_end]
            torch.testing.assert_close(shard.tensor, heads, atol=1e-4, rtol=1e-4)
    assert tp_worker_pids() == []


@pytest.mark.parametrize("name", ["llama-kv2-untied", "qwen2-kv1-untied"])
@pytest.mark.parametrize("swap_space_gb", [0.0, 0.001], ids=["recompute", "swap"])
def test_tp2_preemption_keeps_tp1_tokens(name, swap_space_gb, models, reference):
    want = reference[name][0]
    with LLM(str(models[name]), tensor_parallel_size=2, swap_space_gb=swap_space_gb,
             **{**OPTIONS, "num_kv_blocks": 12}) as llm:
        swapped = _count_swap_outs(llm)
        got = run_all(llm, scenarios=("greedy", "seeded"))
        assert got == {k: want[k] for k in got}
        assert llm.engine.scheduler.num_preemptions > 0
        assert (swapped[0] > 0) == (swap_space_gb > 0)
    assert tp_worker_pids() == []


def _count_swap_outs(llm: LLM) -> list[int]:
    """A counter of the blocks the steps swap out (every rank moves them)."""
    count = [0]
    runner = llm.engine.runner
    execute = runner.execute

    def counting(out):
        count[0] += len(out.blocks_to_swap_out)
        return execute(out)

    runner.execute = counting
    return count


def test_generate_from_the_cli_at_tp2_matches_tp1(tmp_path):
    model = tmp_path / "model"
    save_tiny_model(model, "llama")
    save_tiny_tokenizer(model)
    outs = []
    for size in ("1", "2"):
        run = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "generate", "--model", str(model),
                              "--dtype", "float32", "--kv-cache-memory-gb", "0.01", "--max-tokens", "8",
                              "--tensor-parallel-size", size, "Hello", "abc"],
                             capture_output=True, text=True, timeout=200)
        assert run.returncode == 0, run.stderr[-2000:]
        outs.append(run.stdout)
    assert outs[0] == outs[1] and outs[0].count("->") == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on NCCL needs 2+ CUDA GPUs")
@pytest.mark.parametrize("name", ["llama-kv2-untied", "qwen2-kv1-untied"])
def test_tp2_on_nccl_gives_tp1_tokens(name, models):
    """The CUDA path (NCCL, each rank's pool on its own GPU, mapped by CUDA IPC): greedy TP 2 equals TP 1.
    Its CPU counterpart is test_tp2_gives_tp1_tokens_and_kv (gloo)."""
    options = {**OPTIONS, "device": "cuda"}
    with LLM(str(models[name]), **options) as llm:
        want = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    with LLM(str(models[name]), tensor_parallel_size=2, **options) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        assert_no_leak(llm.engine.block_manager)
    assert tp_worker_pids() == []
