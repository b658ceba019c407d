"""Tensor parallelism's plumbing: the step wire format, the config and CLI checks, and the worker
ranks' life (start-up that fails, a rank killed mid-generation, a node process that dies), each
ending with no worker process left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import msgpack
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel.errors import TPStartupError, TPWorkerError
from pdserve.engine.parallel.step_wire import HostBatch, Step, decode_message, decode_step, encode_step
from tests.conftest import assert_no_leak
from tests.engine.tp_helpers import make_model, tp_worker_pids

TINY = dict(dtype="float32", block_size=8, kv_cache_memory_gb=0.01, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tp-exec"), "llama-kv2-untied")


def _batch(num_tokens: int = 5, num_seqs: int = 2) -> HostBatch:
    return HostBatch(
        input_ids=torch.randint(0, 1000, (num_tokens,), dtype=torch.int64),
        positions=torch.arange(num_tokens, dtype=torch.int64),
        query_start_loc=torch.tensor([0, 3, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([3, 7], dtype=torch.int32),
        block_tables=torch.tensor([[4, -1], [1, 2]], dtype=torch.int32),
        slot_mapping=torch.arange(num_tokens, dtype=torch.int32) - 1,
        logits_indices=torch.tensor([2, num_tokens - 1], dtype=torch.int64),
        max_query_len=3, max_seq_len=7,
    )


# ---- the wire ------------------------------------------------------------------------------
def test_a_step_round_trips_through_msgpack_unchanged():
    step = Step(_batch(), True, [(1, 0), (2, 5)], [(3, 4)], [(0, 7)])
    data = encode_step(step)
    assert isinstance(msgpack.unpackb(data), dict)  # plain msgpack: any peer can read it, nothing pickled
    back = decode_step(decode_message(data))
    assert back.compute_logits and back.blocks_to_swap_out == [(1, 0), (2, 5)]
    assert back.blocks_to_copy == [(3, 4)] and back.blocks_to_swap_in == [(0, 7)]
    for name in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "slot_mapping",
                 "logits_indices"):
        got, want = getattr(back.batch, name), getattr(step.batch, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert (back.batch.max_query_len, back.batch.max_seq_len) == (3, 7)


def test_swap_only_and_logit_free_steps_round_trip():
    swap_only = decode_step(decode_message(encode_step(Step(None, False, [(0, 1)]))))
    assert swap_only.batch is None and not swap_only.compute_logits and not swap_only.is_noop
    assert Step(None).is_noop
    batch = _batch()
    batch.logits_indices = torch.zeros(0, dtype=torch.int64)
    back = decode_step(decode_message(encode_step(Step(batch, False))))
    assert back.batch.logits_indices.shape == (0,) and back.batch.logits_indices.dtype == torch.int64


def test_the_wire_refuses_what_a_step_never_holds():
    batch = _batch()
    batch.input_ids = batch.input_ids.float()
    with pytest.raises(ValueError, match="int32 or int64"):
        encode_step(Step(batch, True))
    message = decode_message(encode_step(Step(_batch(), True)))
    message["batch"]["input_ids"][2] = message["batch"]["input_ids"][2][:-1]  # a truncated array
    with pytest.raises(ValueError, match="bytes"):
        decode_step(message)
    with pytest.raises(ValueError, match="op"):
        decode_message(msgpack.packb([1, 2]))


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=2, speculative_config={"model": "/x", "num_speculative_tokens": 2}), "draft model"),
    (dict(tensor_parallel_size=2, device="cuda:1"), "rank r runs on cuda:r"),
    (dict(tensor_parallel_size=2, tp_timeout_s=0), "tp_timeout_s"),
])
def test_bad_tensor_parallel_configs_get_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        EngineConfig(model_path="/nowhere", **kwargs)
    assert "\n" not in str(info.value)


def test_tensor_parallel_nodes_run_eager_and_accept_ngram():
    cfg = EngineConfig(model_path="/nowhere", device="cuda", tensor_parallel_size=2,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not cfg.use_cuda_graphs
    assert EngineConfig(model_path="/nowhere", device="cuda").use_cuda_graphs


def test_a_size_the_model_cannot_split_fails_before_any_worker_starts(model):
    with pytest.raises(ValueError, match="does not divide the model's 4 attention heads"):
        LLM(str(model), tensor_parallel_size=3, **TINY)
    assert tp_worker_pids() == []


def test_cli_bad_sizes_print_one_line(model, capsys):
    from pdserve.cli.main import main

    for size, match in (("0", "must be an integer >= 1"), ("3", "does not divide")):
        assert main(["generate", "--model", str(model), "--tensor-parallel-size", size, "hi"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert match in err[-1] and err[-1].startswith("pdserve generate: error:")
    assert tp_worker_pids() == []


# ---- start-up faults ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_that_exits_at_start_fails_start_up_at_once(model, monkeypatch):
    monkeypatch.setenv("PDSERVE_TP_WORKER_FAULT", "exit")
    temp = tempfile.mkdtemp(prefix="tpt-")  # short: ipc:// paths have a length limit
    monkeypatch.setattr(tempfile, "tempdir", temp)  # where the executor makes its private directory
    start = time.monotonic()
    with pytest.raises(TPStartupError) as info:
        LLM(str(model), tensor_parallel_size=2, tp_startup_timeout_s=60, **TINY)
    assert time.monotonic() - start < 30  # at once, not after the 60 s start-up timeout
    message = str(info.value)
    assert "\n" not in message and "rank 1" in message and "exited with code 7" in message
    assert "PDSERVE_TP_WORKER_FAULT=exit" in message  # the tail of its stderr
    assert info.value.rank == 1 and info.value.exit_code == 7
    assert tp_worker_pids() == []
    assert os.listdir(temp) == []  # the sockets' private directory is gone
    os.rmdir(temp)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_that_never_comes_up_fails_start_up_at_the_deadline(model, monkeypatch):
    monkeypatch.setenv("PDSERVE_TP_WORKER_FAULT", "hang")
    with pytest.raises(TPStartupError, match=r"rank 1 did not finish starting up within 3 s") as info:
        LLM(str(model), tensor_parallel_size=2, tp_startup_timeout_s=3, **TINY)
    assert "\n" not in str(info.value)
    assert tp_worker_pids() == []
    monkeypatch.delenv("PDSERVE_TP_WORKER_FAULT")
    with LLM(str(model), tensor_parallel_size=2, **TINY) as llm:  # the process group was left clean
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert tp_worker_pids() == []


# ---- a rank that dies --------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_killed_mid_generation_fails_the_step_promptly_and_leaves_no_process(model):
    llm = LLM(str(model), tensor_parallel_size=2, **TINY)
    try:
        engine = llm.engine
        executor = engine.runner.executor
        segments = [shard.shm.path for shard in engine.runner.kv_shards]
        ipc_dir = executor._dir
        assert all(os.path.exists(p) for p in segments)
        engine.add_request(list(range(1, 20)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        os.kill(executor.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TPWorkerError) as info:
            for _ in range(50):
                engine.step()
        assert time.monotonic() - start < 15
        assert info.value.rank == 1 and info.value.exit_code == -signal.SIGKILL
        assert "rank 1" in str(info.value) and "\n" not in str(info.value)
        with pytest.raises(TPWorkerError):  # the node stays failed: the ranks are out of step
            engine.step()
    finally:
        llm.close()
    assert tp_worker_pids() == []
    assert not any(os.path.exists(p) for p in segments)  # every rank's shared-memory pool is gone
    assert not os.path.exists(ipc_dir)
    llm.close()  # idempotent


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_workers_exit_when_the_node_process_dies(model, tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        from pdserve.engine import LLM
        llm = LLM({str(model)!r}, tensor_parallel_size=2, dtype="float32", block_size=8,
                  kv_cache_memory_gb=0.01, skip_tokenizer_init=True)
        print(llm.engine.runner.executor.procs[0].pid, flush=True)
        os._exit(0)  # no atexit, no close: as if killed
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    worker_pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(worker_pid):
        time.sleep(0.1)
    assert not _running(worker_pid)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_per_rank_weights_are_half_at_tp_2(model):
    with LLM(str(model), **TINY) as llm:
        full = _param_bytes(llm.engine.runner.model)
    with LLM(str(model), tensor_parallel_size=2, **TINY) as llm:
        runner = llm.engine.runner
        ranks = [_param_bytes(runner.model), *runner.executor.worker_param_bytes]
        assert [s.head_start for s in runner.kv_shards] == [0, 1] and runner.kv_buffer.shape[4] == 1
        assert_no_leak(llm.engine.block_manager)
    assert len(ranks) == 2
    for size in ranks:  # halves, plus the replicated norms
        assert 0.49 * full < size < 0.52 * full, (size, full)


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
