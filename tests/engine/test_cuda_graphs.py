"""Decode CUDA graphs (engine/cuda_graphs.py).

On the CPU the static, padded buffers run eagerly (`init_decode_graphs` captures only on CUDA), so
these tests check what the graphs depend on: bucket choice, padding rows that change nothing,
buffers that carry no state from one step to the next, and greedy parity with transformers. The
`gpu` tests check capture and replay against `enforce_eager=True`.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pdserve.engine.llm_engine import LLMEngine
from tests.conftest import assert_no_leak, save_tiny_model
from tests.engine.test_generate_parity import hf_greedy, make_prompts

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64  # 16 blocks per sequence
NUM_BLOCKS = 300  # room for 17 requests of 16 distinct blocks each


def test_capture_sizes_and_buckets():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(4096)[-1] == 512  # larger decode batches run eagerly
    graphs = DecodeGraphs(torch.nn.Identity(), [], max_num_seqs=20, max_model_len=MAX_MODEL_LEN,
                          block_size=BLOCK_SIZE, device=torch.device("cpu"))
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 20)] == [1, 2, 4, 4, 8, 8, 16, 16, 20, 20]
    assert graphs.block_tables.shape == (20, MAX_MODEL_LEN // BLOCK_SIZE)


def test_enforce_eager_flag_reaches_the_config(tmp_path):
    import argparse

    from pdserve.engine.args import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, eager in (([], False), (["--enforce-eager"], True)):
        kwargs = engine_kwargs(parser.parse_args(argv))
        assert kwargs["enforce_eager"] is eager
        config = EngineConfig(model_path=tmp_path, **dict(kwargs, device="cuda"))
        assert config.use_cuda_graphs is not eager
    assert not EngineConfig(model_path=tmp_path).use_cuda_graphs  # the CPU never captures


@pytest.fixture
def engine(tiny_llama) -> LLMEngine:
    config = EngineConfig(model_path=tiny_llama, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
                          max_model_len=MAX_MODEL_LEN, max_num_seqs=16, num_threads=2)
    engine = LLMEngine(config)
    assert engine.runner.decode_graphs is None  # the CPU never captures unless asked
    engine.runner.init_decode_graphs(MAX_MODEL_LEN)
    torch.manual_seed(0)
    engine.runner.kv_buffer.normal_()  # every block holds some request's K/V
    return engine


def make_decode_batch(num_seqs: int, rng: random.Random, extra_columns: int = 0):
    """(input_ids, positions, metadata) of one decode step as prepare_batch builds it: ragged
    context lengths, distinct random blocks per request, block tables -1 padded to the widest
    request plus `extra_columns`."""
    physical = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    seq_lens = [rng.randint(1, MAX_MODEL_LEN) for _ in range(num_seqs)]
    tables = []
    for seq_len in seq_lens:
        num_blocks = -(-seq_len // BLOCK_SIZE)
        tables.append(physical[:num_blocks])
        physical = physical[num_blocks:]
    width = min(max(map(len, tables)) + extra_columns, MAX_MODEL_LEN // BLOCK_SIZE)
    block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
    positions = torch.tensor(seq_lens, dtype=torch.int64) - 1
    rows = torch.arange(num_seqs)
    slots = block_tables[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    meta = AttentionMetadata(
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slots.to(torch.int32),
        max_query_len=1,
        max_seq_len=max(seq_lens),
    )
    input_ids = torch.tensor([rng.randrange(3, 256) for _ in range(num_seqs)], dtype=torch.int64)
    return input_ids, positions, meta


def check_same_pool(got: torch.Tensor, want: torch.Tensor, slots: torch.Tensor, what: str) -> None:
    """Pools [layers, 2, blocks, block_size, kv_heads, head_dim]: the step's own slots hold close
    K/V (a GEMM over 16 rows may round differently from one over 9), every other slot is
    untouched to the bit: padding rows wrote nothing."""
    got, want = got.flatten(2, 3).flatten(3), want.flatten(2, 3).flatten(3)  # [layers, 2, slots, kv]
    written = torch.zeros(got.shape[2], dtype=torch.bool)
    written[slots] = True
    assert torch.equal(got[:, :, ~written], want[:, :, ~written]), f"{what}: a slot outside the batch changed"
    torch.testing.assert_close(got[:, :, written], want[:, :, written], atol=1e-5, rtol=1e-5, msg=what)


@torch.inference_mode()
def test_padded_path_equals_eager_for_every_batch_size(engine):
    """Batch sizes 1..17 (buckets 1, 2, 4, 8, 16 and sizes between; 17 > 16 stays eager), in an
    order that shrinks after large batches so stale rows are left behind: the plain forward's
    logits and greedy tokens, and its KV pool after the step (padding writes nothing). Not bit
    for bit: the CPU's GEMMs round a row differently with a different number of rows (~1e-6)."""
    runner, graphs = engine.runner, engine.runner.decode_graphs
    rng = random.Random(0)
    sizes = [9, 1, 2, 3, 16, 5, 4, 6, 7, 8, 17, 10, 3, 15, 1]
    for step, num_seqs in enumerate(sizes):
        input_ids, positions, meta = make_decode_batch(num_seqs, rng, extra_columns=step % 3)
        assert graphs.can_run(input_ids, meta) == (num_seqs <= 16)
        if not graphs.can_run(input_ids, meta):
            continue
        pool_before = runner.kv_buffer.clone()
        want = runner.model(input_ids, positions, meta, runner.kv_caches)
        pool_eager = runner.kv_buffer.clone()
        runner.kv_buffer.copy_(pool_before)
        got = graphs.run(input_ids, positions, meta)
        assert got.shape == want.shape
        check_same_pool(runner.kv_buffer, pool_eager, meta.slot_mapping.long(), f"batch of {num_seqs}")
        torch.testing.assert_close(runner.model.compute_logits(got), runner.model.compute_logits(want),
                                   atol=1e-5, rtol=1e-5, msg=f"batch of {num_seqs}")
        assert torch.equal(runner.model.compute_logits(got).argmax(-1), runner.model.compute_logits(want).argmax(-1))
        bucket = graphs.bucket(num_seqs)
        assert torch.all(graphs.slot_mapping[num_seqs:bucket] == -1)
        assert torch.all(graphs.seq_lens[num_seqs:bucket] == 1)
    assert graphs.num_replays == 0  # no graphs on the CPU


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU; the test wires replay() to the eager forward."""

    def __init__(self) -> None:
        self.replay = None


@torch.inference_mode()
def test_capture_and_replay_flow_with_fake_graphs(engine, monkeypatch):
    """capture() and the replay branch of run() without CUDA: graphs are faked so that a replay
    recomputes the bucket's forward into the captured output buffer, as a real one would."""
    import contextlib

    captured = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    runner, graphs = engine.runner, engine.runner.decode_graphs
    forward = graphs._forward
    monkeypatch.setattr(graphs, "_forward", lambda size: captured.append(size) or forward(size))
    graphs.capture()
    assert captured == [size for size in reversed(graphs.batch_sizes) for _ in (0, 1)]  # warm-up, capture
    for size, graph in graphs.graphs.items():
        graph.replay = lambda size=size: graphs.outputs[size].copy_(forward(size))
    rng = random.Random(2)
    for num_seqs in (3, 16, 1, 9):
        input_ids, positions, meta = make_decode_batch(num_seqs, rng)
        pool_before = runner.kv_buffer.clone()
        want = runner.model(input_ids, positions, meta, runner.kv_caches)
        runner.kv_buffer.copy_(pool_before)
        got = graphs.run(input_ids, positions, meta)
        assert got.data_ptr() == graphs.outputs[graphs.bucket(num_seqs)].data_ptr()  # the static output
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graphs.num_replays == 4


def test_prefill_steps_stay_eager(engine):
    graphs = engine.runner.decode_graphs
    _, _, meta = make_decode_batch(2, random.Random(1))
    meta.max_query_len = 3  # a request with several new tokens
    assert not graphs.can_run(torch.zeros(4, dtype=torch.int64), meta)


def test_engine_greedy_through_padded_path_equals_transformers(tiny_llama):
    """The whole engine with the padded decode path forced on the CPU: prompts of 1..200 tokens,
    max_tokens 3..12 so the decode batch shrinks through sizes that are not buckets."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompts = make_prompts(n=7, lengths=(1, 7, 17, 33, 64, 100, 200))
    max_tokens = [3, 12, 5, 9, 7, 4, 11]
    want = [w[:m] for w, m in zip(hf_greedy(model, prompts), max_tokens)]

    llm = LLM(str(tiny_llama), dtype="float32", num_threads=2, max_num_seqs=6, max_num_batched_tokens=96,
              kv_cache_memory_gb=0.05)
    runner = llm.engine.runner
    runner.init_decode_graphs(llm.engine.config.max_model_len)
    padded_batches = []
    run = runner.decode_graphs.run

    def spy(input_ids, positions, meta):
        padded_batches.append(input_ids.shape[0])
        return run(input_ids, positions, meta)

    runner.decode_graphs.run = spy
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m, temperature=0) for m in max_tokens])
    assert [o.token_ids for o in outs] == want
    assert set(padded_batches) - {1, 2, 4, 6}, f"no batch needed padding: {sorted(set(padded_batches))}"
    assert_no_leak(llm.engine.block_manager)


# ---- on a GPU: captured graphs against enforce_eager ---------------------------------------

gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in gpu_check.sh)")]


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=gpu), pytest.param("bfloat16", marks=gpu)])
def test_graphs_equal_enforce_eager_on_gpu(tmp_path, dtype):
    """Greedy outputs with graphs equal enforce_eager's, and the decode steps replayed graphs.
    max_model_len 256 keeps every decode unsplit on both paths (the graphs plan splits for
    max_model_len, eager for the batch's longest), so the attention sums in the same order."""
    save_tiny_model(tmp_path, "llama")
    prompts = make_prompts(n=10, lengths=(1, 7, 17, 33, 64, 100, 150, 200))
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (16, 4, 9, 16, 12, 3, 16, 7, 10, 16)]
    outputs = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path), dtype=dtype, device="cuda", max_model_len=256, max_num_seqs=12,
                  max_num_batched_tokens=128, enforce_eager=eager)
        outputs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.decode_graphs
        if eager:
            assert graphs is None
        else:
            assert sorted(graphs.graphs) == graphs.batch_sizes == [1, 2, 4, 8, 12]
            assert graphs.num_replays > 0
        assert_no_leak(llm.engine.block_manager)
        del llm, graphs
        gc.collect()  # the next engine sizes its pool from what is free
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]
