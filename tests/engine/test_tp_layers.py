"""Tensor parallelism, layer and model level: 2 ranks in 2 processes (gloo on 127.0.0.1, started
here with subprocess, arguments as JSON) compute what 1 rank computes, in float32.

Each rank runs tests/engine/tp_layer_script.py; the TP 1 reference runs the same code in this
process. Every test stops its processes on every path (stop_processes in a finally).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pdserve.utils.processes import free_port, stop_processes
from tests.conftest import save_tiny_model
from tests.engine import tp_layer_script as script

REPO_ROOT = Path(__file__).resolve().parents[2]
TIGHT = dict(rtol=1e-5, atol=1e-5)  # float32: only the summation order differs between TP 1 and TP 2


def run_ranks(tmp_path: Path, mode: str, size: int = 2, num_procs: int | None = None, timeout_s: float = 20.0,
              wait_s: float = 90.0, **extra) -> list[dict]:
    """Start ranks 0..num_procs-1 of `size`, wait for all (at most wait_s), stop them on every path;
    returns each rank's JSON output. A rank that fails shows its stderr."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs, logs = [], []
    try:
        for rank in range(size if num_procs is None else num_procs):
            args = dict(rank=rank, size=size, init_method=init_method, timeout_s=timeout_s, mode=mode,
                        out=str(tmp_path), **extra)
            log = (tmp_path / f"rank{rank}.log").open("wb")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.engine.tp_layer_script", json.dumps(args)],
                                          cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + wait_s
        wait_for = procs if mode not in ("dead_peer", "hung_peer") else procs[:1]  # rank 1 dies / hangs on purpose
        for rank, proc in enumerate(wait_for):
            rc = proc.wait(max(0.1, deadline - time.monotonic()))
            assert rc == 0, f"rank {rank} exited {rc}: {(tmp_path / f'rank{rank}.log').read_text()[-2000:]}"
        return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(len(wait_for))]
    finally:
        stop_processes(procs, timeout_s=5)
        for log in logs:
            log.close()
        assert all(p.poll() is not None for p in procs)


def rank_tensors(tmp_path: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(tmp_path / f"rank{rank}.safetensors"))


# ---- layers ---------------------------------------------------------------------------------
def test_layers_at_size_1_are_plain_linear_and_embedding():
    out = script.run_layers(0, 1)
    w = script.layer_weights()
    gate_up = F.linear(w["x"], torch.cat([w["gate"], w["up"]]), torch.cat([w["gate_bias"], w["up_bias"]]))
    assert torch.equal(out["columns"], gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(out["mlp"], F.linear(F.silu(gate) * up, w["down"]))
    assert torch.equal(out["embed"], F.embedding(torch.arange(script.VOCAB), w["embed"]))
    assert torch.equal(out["logits"], F.linear(w["x"], w["head"]))
    assert out["logits_empty"].shape == (0, script.VOCAB)


@pytest.mark.timeout(120)
def test_layers_at_size_2_match_size_1(tmp_path):
    run_ranks(tmp_path, "layers")
    full = script.run_layers(0, 1)
    half = script.INTER // 2
    for rank in range(2):
        got = rank_tensors(tmp_path, rank)
        rows = slice(rank * half, (rank + 1) * half)
        gate, up = full["columns"].chunk(2, dim=-1)
        torch.testing.assert_close(got["columns"], torch.cat([gate[:, rows], up[:, rows]], dim=-1), **TIGHT)
        torch.testing.assert_close(got["mlp"], full["mlp"], **TIGHT)  # row-parallel + all-reduce
        assert torch.equal(got["embed"], full["embed"])  # odd vocab (11): rank 1 holds 5 ids and a zero pad row
        torch.testing.assert_close(got["logits"], full["logits"], **TIGHT)  # gathered, cut back to 11 columns
        assert got["logits_empty"].shape == (0, script.VOCAB)
        torch.testing.assert_close(got["mlp_bf16"], full["mlp_bf16"], rtol=2e-2, atol=5e-2)  # bf16 rounding only


# ---- the whole model ------------------------------------------------------------------------
MODELS = {
    "llama-kv2-untied": ("llama", dict(tie_word_embeddings=False)),
    "llama-kv1-tied-odd-vocab": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=261)),
    "qwen2-kv2-tied-odd-vocab": ("qwen2", dict(vocab_size=263)),
    "qwen2-kv1-untied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False)),
}


FAST_CASE = "llama-kv1-tied-odd-vocab"  # replication, tied embeddings and an odd vocab in the fast tier


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", [c if c == FAST_CASE else pytest.param(c, marks=pytest.mark.slow) for c in MODELS])
def test_model_at_tp2_matches_tp1(case, tmp_path):
    arch, overrides = MODELS[case]
    model_dir = tmp_path / "model"
    hf = save_tiny_model(model_dir, arch, **overrides)
    out = tmp_path / "out"
    out.mkdir()
    expected, expected_seqs = script.run_model(str(model_dir))
    values = run_ranks(out, "model", model_dir=str(model_dir))
    num_kv_heads = hf.config.num_key_value_heads
    for rank in range(2):
        got = rank_tensors(out, rank)
        assert values[rank]["seqs"] == expected_seqs  # the same greedy tokens
        for step in range(script.NUM_STEPS):
            torch.testing.assert_close(got[f"hidden_{step}"], expected[f"hidden_{step}"], **TIGHT)
            assert got[f"logits_{step}"].dtype == torch.float32
            assert got[f"logits_{step}"].shape == expected[f"logits_{step}"].shape  # full vocab on every rank
            torch.testing.assert_close(got[f"logits_{step}"], expected[f"logits_{step}"], **TIGHT)
        # the rank's pool holds exactly its KV heads (one replicated head each when num_kv_heads = 1)
        start = rank * num_kv_heads // 2
        heads = slice(start, start + max(1, num_kv_heads // 2))
        torch.testing.assert_close(got["kv"], expected["kv"][..., heads, :], **TIGHT)
    both = [rank_tensors(out, rank) for rank in range(2)]
    assert all(torch.equal(both[0][k], both[1][k]) for k in both[0] if k != "kv")  # ranks agree bit for bit


# ---- faults ---------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_dead_peer_makes_the_collective_raise(tmp_path):
    [rank0] = run_ranks(tmp_path, "dead_peer", timeout_s=10)
    assert rank0["error"] and "all_reduce failed on rank 0 of 2" in rank0["error"]
    assert rank0["elapsed_s"] < 15


@pytest.mark.timeout(60)
def test_hung_peer_times_out_the_collective(tmp_path):
    [rank0] = run_ranks(tmp_path, "hung_peer", timeout_s=3)
    assert rank0["error"] and "timeout 3 s" in rank0["error"]
    assert 2 <= rank0["elapsed_s"] < 20


@pytest.mark.timeout(60)
def test_rank_that_never_joins_fails_init(tmp_path):
    [rank0] = run_ranks(tmp_path, "alone", num_procs=1, timeout_s=3)
    assert "rank 0 of 2 could not join the group" in rank0["init_error"]
    assert rank0["elapsed_s"] < 20
