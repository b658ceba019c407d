"""benchmarks/cpu_floor.py runs end to end on a tiny model and reports every figure it promises."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import cpu_floor
from pdserve.kernels import cpu_native
from tests.conftest import TINY_SHAPE, save_tiny_model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cpu_floor_reports_gemm_floor_bandwidth_and_step_ratios(tmp_path, capsys, dtype):
    save_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "floor.json"
    assert cpu_floor.main(["--model", str(tmp_path / "m"), "--dtype", dtype, "--batch-sizes", "1,2",
                           "--context-len", "16", "--num-threads", "1", "--repeats", "2", "--warmup", "1",
                           "--bandwidth-mb", "64", "--prefill-tokens", "48", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["cpu"]["flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert isinstance(result["cpu"]["native_bf16"], bool)
    assert result["read_bandwidth_gbs"] > 0 and result["weight_stream_ms"] > 0
    # the floor streams the tiny model's linears (2 layers and an untied lm_head) once, in its dtype;
    # the engine may hold more (a bf16 model keeps an fp32 copy on a CPU without native bf16)
    h, i, v, layers = (TINY_SHAPE[k] for k in ("hidden_size", "intermediate_size", "vocab_size", "num_hidden_layers"))
    linear_weights = layers * (h * 2 * h + h * h + 3 * h * i) + v * h
    assert result["weight_bytes_per_step"] == getattr(torch, dtype).itemsize * linear_weights
    assert result["engine_weight_bytes"] >= result["weight_bytes_per_step"]
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert f"torch-{dtype}" in row["gemm_ms"] and all(ms > 0 for ms in row["gemm_ms"].values())
        # the engine's own GEMM counts toward the floor where the engine runs it (bf16, ops built)
        assert (f"pdserve-panels-{dtype}" in row["gemm_ms"]) == (cpu_native.load() is not None)
        assert row["gemm_floor_ms"] == min(row["gemm_ms"].values())
        assert row["gemm_ms"][row["gemm_floor_path"]] == row["gemm_floor_ms"]
        assert row["step_ms"] > 0 and row["step_over_gemm_floor"] == pytest.approx(row["step_ms"] / row["gemm_floor_ms"])
        assert row["paired_step_over_gemm_floor"] > 0 and "calls" not in row
    assert result["batch1_step_over_stream"] == pytest.approx(result["rows"][0]["step_ms"] / result["weight_stream_ms"])
    assert result["batch1_paired_step_over_stream"] == result["rows"][0]["paired_step_over_stream"] > 0
    assert "paired_step_over_stream" not in result["rows"][1]  # batch 1 only
    pre = result["prefill"]
    assert pre["tokens"] == 48 and pre["step_ms"] > 0 and pre["gemm_floor_ms"] == min(pre["gemm_ms"].values())
    assert pre["gemm_floor_over_step"] == pytest.approx(pre["gemm_floor_ms"] / pre["step_ms"])
    assert pre["paired_gemm_floor_over_step"] > 0 and "calls" not in pre
    printed = capsys.readouterr().out
    assert "prefill of 48 tokens" in printed
    assert "avx512_bf16=" in printed and "floor path" in printed and "step / weight streaming" in printed
    assert "paired" in printed


@pytest.mark.timeout(120)
def test_the_paired_ratio_divides_each_step_by_the_floor_run_just_before_it(tmp_path, monkeypatch):
    import statistics
    from argparse import Namespace

    save_tiny_model(tmp_path / "m", "llama")
    args = Namespace(model=str(tmp_path / "m"), dtype="float32", num_threads=1, context_len=16, warmup=1, repeats=3)
    floors = [9.0, 0.002, 0.004, 0.008]  # seconds the floor "took" before each step (the warm-up's first)
    calls = iter(floors)
    monkeypatch.setattr(cpu_floor, "_run_calls", lambda _: next(calls))
    bandwidths = iter([1.0, 2.0, 4.0, 8.0])  # GB/s read before each step (the warm-up's first)
    step_ms, _, ratios, stream_ratios = cpu_floor.engine_step_ms(args, 1, floor_calls=[],
                                                                 stream=(lambda: next(bandwidths), 10**9))
    assert len(ratios) == 3 and len(stream_ratios) == 3
    step_s = [r * f for r, f in zip(ratios, floors[1:])]  # each timed step over its own floor
    assert 1e3 * statistics.median(step_s) == pytest.approx(step_ms)
    # and over the streaming time of 1 GB at the bandwidth read just before it: 1/2, 1/4, 1/8 s
    assert [r * 2.0**-k for r, k in zip(stream_ratios, (1, 2, 3))] == pytest.approx(step_s)
    assert cpu_floor.engine_step_ms(args, 1)[2:] == ([], [])  # no floor calls or reader, no pairs


def test_linear_shapes_cover_the_fused_projections_and_the_lm_head():
    from pdserve.engine.model_config import ModelConfig

    config = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=8192)
    assert cpu_floor.linear_shapes(config) == [("qkv", 576, 960, 30), ("o", 576, 576, 30), ("gate_up", 576, 3072, 30),
                                               ("down", 1536, 576, 30), ("lm_head", 576, 49152, 1)]


@pytest.mark.timeout(120)
def test_onednn_ab_times_every_variant_on_a_tiny_model(tmp_path, capsys):
    from benchmarks import onednn_ab

    save_tiny_model(tmp_path / "m", "llama")
    assert onednn_ab.main(["--model", str(tmp_path / "m"), "--dtype", "float32", "--batch", "2",
                           "--context-len", "8", "--num-threads", "1", "--steps", "2"]) == 0
    printed = capsys.readouterr().out
    # the tiny model's layers are below the size that pays for a copy: "wide" packs none, "all" every one
    assert "'wide': 0" in printed and "'none': 0" in printed and "'all': 0" not in printed
    for variant in ("none", "wide", " all"):
        assert f"copies for {variant}: median" in printed
