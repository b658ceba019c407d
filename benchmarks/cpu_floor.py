"""How close the engine's CPU decode step is to this machine's floor.

    python -m benchmarks.cpu_floor --model smollm2 --dtype bfloat16 --batch-sizes 1,16,64 \
        --context-len 256 --num-threads 2 --repeats 7 --json /tmp/cpu_floor.json

Everything is measured here, in one process, as medians of --repeats:

  GEMM floor  every linear of one decode step at its real shape (per layer the fused qkv, o,
              gate_up and down, times the layers, then the lm_head on the B sampled rows), run as
              a sequence of calls on preallocated inputs, through each GEMM path the CPU has:
                torch-<dtype>       F.linear in the model's dtype
                torch-float32       F.linear in fp32 (what a bf16 model runs without native bf16:
                                    engine/models/cpu_bf16.py)
                onednn-packed-*     oneDNN with weights reordered once (inductor's freezing path)
                mkl-packed-float32  MKL's packed sgemm; its pack is valid for one batch size only
                pdserve-panels-<dtype>  the engine's own GEMM on the weights in panels
                                    (kernels/cpu_elementwise.cpp, cpu_decode_attention.cpp; bf16 and fp32 models, where the ops build)
                pdserve-tiles-bfloat16  the engine's AMX GEMM on bf16 weights packed as tiles
                                    (kernels/cpu_amx.cpp; bf16 models on CPUs with AMX)
              The paths take turns within every repeat, so drift hits them alike; the fastest
              median is the floor.
  bandwidth   read bandwidth: a sum over a tensor far larger than the last-level cache.
  streaming   the bytes of the model's linear weights in its dtype (every one a step multiplies
              by, the lm_head included) / bandwidth: the floor of a batch-1 step, which is
              memory-bound. What the engine holds (an fp32 copy, oneDNN copies) is reported beside
              it, not counted: reading a copy bigger than the model is the engine's cost.
  step        the engine's decode step: B requests of --context-len random tokens decoding
              together (max_num_seqs=B, ignore_eos), the median of --repeats engine.step() calls.
  bytes       the weights' bytes plus the K and V the step's attention reads (every layer, B x
              --context-len tokens) over the read bandwidth: the floor of a step that reads
              both from memory once; step / it is printed per batch.
  paired      the median over those steps of step / the GEMM floor's linears (its fastest path)
              run just before that step: the machine's speed drifts by up to 1.5x between
              minutes, and step/floor divides two medians taken minutes apart; a pair is not.
              At batch 1 also step / the streaming floor at the bandwidth read just before it.
  prefill     one request's --prefill-tokens prompt prefilled in one step (a fresh random prompt
              each repeat), against the GEMM floor of those rows (the lm_head on the one row
              sampled): the share of the step its GEMMs would take at the floor; paired as above
              (each step against the floor's linears run just before it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.decoding import start_decodes

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
MAX_BATCHED_TOKENS = 2048  # the engine's default


def cpu_info() -> dict:
    from pdserve.engine.config import cpu_has_native_bf16

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")), set())
    return {"model_name": model, "flags": {f: f in flags for f in CPU_FLAGS},
            "native_bf16": cpu_has_native_bf16(), "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def linear_shapes(config) -> list[tuple[str, int, int, int]]:
    """(name, in_features, out_features, calls per decode step) of every linear, in call order."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    n = config.num_layers
    return [("qkv", h, q + 2 * kv, n), ("o", q, h, n), ("gate_up", h, 2 * config.intermediate_size, n),
            ("down", config.intermediate_size, h, n), ("lm_head", h, config.vocab_size, 1)]


# ---- GEMM paths: each turns an fp32 weight [out, in] into a call x -> y, and names the input dtype
def _torch_path(dtype: torch.dtype):
    def prepare(w: torch.Tensor, batch: int) -> Callable:
        w = w.to(dtype)
        return lambda x: F.linear(x, w)
    return prepare, dtype


def _onednn_path(dtype: torch.dtype):
    def prepare(w: torch.Tensor, batch: int) -> Callable:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.to(dtype), batch)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return prepare, dtype


def _mkl_packed_path():
    def prepare(w: torch.Tensor, batch: int) -> Callable:
        packed = torch.ops.mkl._mkl_reorder_linear_weight(w, batch)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, w, None, batch)
    return prepare, torch.float32


def _panels_path(dtype: torch.dtype):
    """pdserve's compiled GEMM on weights of `dtype` packed in panels (kernels/cpu_gemm.cpp), fp32 input."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.load()

    def prepare(w: torch.Tensor, batch: int) -> Callable:
        panels = ops.pack_panels(w.to(dtype))
        return lambda x: ops.gemm_panels(x, panels, w.shape[0], None)
    return prepare, torch.float32


def _tiles_path():
    """pdserve's AMX GEMM on bf16 weights packed as tiles (kernels/cpu_amx.cpp), bf16 in and out."""
    from pdserve.kernels import cpu_native

    ops = cpu_native.load()

    def prepare(w: torch.Tensor, batch: int) -> Callable:
        tiles = ops.pack_tiles(w.to(torch.bfloat16))
        return lambda x: ops.gemm_tiles(x, tiles, w.shape[0], None, True)
    return prepare, torch.bfloat16


def gemm_paths(dtype: torch.dtype) -> dict[str, tuple[Callable, torch.dtype]]:
    paths = {f"torch-{_name(dtype)}": _torch_path(dtype)}
    if dtype != torch.float32:
        paths["torch-float32"] = _torch_path(torch.float32)
    if torch.backends.mkldnn.is_available():
        paths["onednn-packed-float32"] = _onednn_path(torch.float32)
        if dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported():
            paths["onednn-packed-bfloat16"] = _onednn_path(torch.bfloat16)
        if torch.backends.mkl.is_available():
            paths["mkl-packed-float32"] = _mkl_packed_path()
    from pdserve.kernels import cpu_native

    if dtype in (torch.bfloat16, torch.float32) and cpu_native.load() is not None:  # what a layer runs at 1-64 rows
        paths[f"pdserve-panels-{_name(dtype)}"] = _panels_path(dtype)
        if dtype == torch.bfloat16 and cpu_native.load().amx_available():
            paths["pdserve-tiles-bfloat16"] = _tiles_path()
    return paths


def gemm_floor(config, dtype: torch.dtype, batch: int, repeats: int, logit_rows: int | None = None) -> dict:
    """Milliseconds of one step's linears per path (median), and the fastest path: `batch` rows
    through every layer, `logit_rows` (default: batch) through the lm_head. A decode step samples
    every row; a prefill chunk of one request samples its last token only. "calls" runs the
    fastest path's linears once more (engine_step_ms pairs it with the engine's steps)."""
    g = torch.Generator().manual_seed(0)
    shapes = linear_shapes(config)
    steps = {}
    for name, (prepare, in_dtype) in gemm_paths(dtype).items():
        calls = []
        for shape_name, k, n, count in shapes:
            rows = batch if shape_name != "lm_head" or logit_rows is None else logit_rows
            x = torch.randn(rows, k, generator=g).to(in_dtype)
            for _ in range(count):  # distinct weights per layer: the step streams them all
                calls.append((prepare(torch.randn(n, k, generator=g) * k**-0.5, batch), x))
        steps[name] = calls
    times = {name: [] for name in steps}
    with torch.inference_mode():
        for i in range(repeats + 1):  # the first round warms every path up
            for name, calls in steps.items():
                start = time.perf_counter()
                _run_calls(calls)
                if i:
                    times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    best = min(ms, key=ms.get)
    return {"gemm_ms": ms, "gemm_floor_ms": ms[best], "gemm_floor_path": best, "calls": steps[best]}


def _run_calls(calls: list) -> float:
    """Run a path's linears once; the seconds they took."""
    start = time.perf_counter()
    with torch.inference_mode():
        for call, x in calls:
            call(x)
    return time.perf_counter() - start


def bandwidth_reader(size_mb: int) -> Callable[[], float]:
    """A call that reads `size_mb` of fp32 once (a sum, far above the L3, so it streams from DRAM)
    and returns the GB/s it took."""
    x = torch.ones(size_mb * 2**20 // 4)
    x.sum()

    def read() -> float:
        start = time.perf_counter()
        x.sum()
        return x.numel() * 4 / (time.perf_counter() - start) / 1e9
    return read


def model_weight_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of every linear weight a decode step multiplies by, once each, in the model's dtype."""
    return sum(k * n * count for _, k, n, count in linear_shapes(config)) * dtype.itemsize


def kv_bytes(config, dtype: torch.dtype, batch: int, context_len: int) -> int:
    """Bytes of K and V a decode step's attention reads: every layer's, of `batch` sequences of
    `context_len` tokens (the GEMM floor leaves them out; at batch 16 and 256 tokens they are a
    third of the default model's weights)."""
    return batch * context_len * config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype.itemsize


def engine_weight_bytes(model) -> int:
    """Bytes of weights a decode step reads, as the engine holds them (bf16, an fp32 copy, a packed
    copy): every module's parameters and buffers but the embedding (one row a token) and the RoPE
    tables (a few rows)."""
    skip = {id(model.embed_tokens), id(model.rotary)}
    return sum(t.numel() * t.element_size() for module in model.modules() if id(module) not in skip
               for t in [*module.parameters(recurse=False), *module.buffers(recurse=False), *_gemm_copies(module)]
               if t is not None)


def _gemm_copies(module) -> list:
    """The weight copies a layer keeps outside its parameters and buffers (engine/ops/linear.py): the
    panels, the AMX tiles and oneDNN's copy (counted by its elements)."""
    copies = []
    for name, inner in (("panels", "panels"), ("tiles", "tiles")):
        holder = getattr(module, name, None)
        if holder is not None and isinstance(getattr(holder, inner, None), torch.Tensor):
            copies.append(getattr(holder, inner))
    packed = getattr(module, "packed", None)
    if isinstance(packed, torch.Tensor) and not any(packed is b for b in module.buffers(recurse=False)):
        copies.append(packed)
    return copies


def engine_step_ms(args, batch: int, floor_calls: list | None = None,
                   stream: tuple[Callable[[], float], int] | None = None) -> tuple[float, int, list[float], list[float]]:
    """Median ms of a decode step with `batch` sequences of context_len tokens, the weight bytes, and
    (with `floor_calls`, the GEMM floor's linears, run just before each timed step) each step's time
    over the floor's time next to it: the machine's speed drifts between minutes, a pair does not.
    With `stream` (a bandwidth reader, the weight bytes), also each step's time over the weights'
    streaming time at the bandwidth read just before it."""
    from pdserve.engine import LLM, SamplingParams

    # chunked prefill takes several steps, and a request that has its first token decodes in the rest
    prefill_steps = -(-batch * args.context_len // MAX_BATCHED_TOKENS) + 1
    max_tokens = prefill_steps + args.warmup + args.repeats + 2
    block_size = 16
    blocks = batch * (-(-(args.context_len + max_tokens + 1) // block_size) + 1)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=batch,
              num_kv_blocks=blocks, block_size=block_size, max_num_batched_tokens=MAX_BATCHED_TOKENS,
              skip_tokenizer_init=True,
              max_model_len=args.context_len + max_tokens + 1)
    try:
        engine = llm.engine
        start_decodes(engine, batch, args.context_len, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      ignore_eos=True), seed=batch)
        times, ratios, stream_ratios = [], [], []
        for i in range(args.warmup + args.repeats):
            floor_s = _run_calls(floor_calls) if floor_calls is not None else None
            stream_s = None if stream is None else stream[1] / (stream[0]() * 1e9)
            start = time.perf_counter()
            engine.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
                if floor_s is not None:
                    ratios.append(times[-1] / floor_s)
                if stream_s is not None:
                    stream_ratios.append(times[-1] / stream_s)
        assert len(engine.scheduler.running) == batch, "every request decodes in the timed steps"
        return 1e3 * statistics.median(times), engine_weight_bytes(engine.runner.model), ratios, stream_ratios
    finally:
        llm.close()


def engine_prefill_ms(args, num_tokens: int, floor_calls: list | None = None) -> tuple[float, list[float]]:
    """Median ms of an engine step that prefills one request's `num_tokens`-token prompt in one
    chunk (fresh random prompts: no prefix-cache hit), over --repeats, after --warmup; and, with
    `floor_calls` (the GEMM floor's linears, run just before each timed step), each pair's floor
    time over its step time (the machine's speed drifts between minutes, a pair does not)."""
    from pdserve.engine import LLM, SamplingParams

    block_size = 16
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=1, block_size=block_size,
              num_kv_blocks=-(-(num_tokens + 2) // block_size) + 1, max_num_batched_tokens=num_tokens,
              skip_tokenizer_init=True, max_model_len=num_tokens + 2)
    try:
        engine = llm.engine
        g = torch.Generator().manual_seed(num_tokens)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        times, ratios = [], []
        for i in range(args.warmup + args.repeats):
            engine.add_request(torch.randint(engine.model_config.vocab_size, (num_tokens,), generator=g).tolist(),
                               params)
            floor = _run_calls(floor_calls) if floor_calls else None
            start = time.perf_counter()
            engine.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
                if floor is not None:
                    ratios.append(floor / times[-1])
            assert not engine.has_unfinished(), "the prompt is prefilled (and its one token sampled) in one step"
        return 1e3 * statistics.median(times), ratios
    finally:
        llm.close()


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run(args) -> dict:
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig
    from pdserve.kvcache.dtypes import parse_dtype

    torch.set_num_threads(args.num_threads)
    config = ModelConfig.from_pretrained(resolve_model(args.model))
    dtype = parse_dtype(args.dtype)
    reader = bandwidth_reader(args.bandwidth_mb)
    bandwidth = statistics.median(reader() for _ in range(args.repeats))
    weight_bytes = model_weight_bytes(config, dtype)
    rows = []
    for batch in args.batch_sizes:
        row = {"batch": batch, **gemm_floor(config, dtype, batch, args.repeats)}
        row["step_ms"], engine_bytes, ratios, stream_ratios = engine_step_ms(
            args, batch, row.pop("calls"), (reader, weight_bytes) if batch == 1 else None)
        row["step_over_gemm_floor"] = row["step_ms"] / row["gemm_floor_ms"]
        row["paired_step_over_gemm_floor"] = statistics.median(ratios)
        if stream_ratios:
            row["paired_step_over_stream"] = statistics.median(stream_ratios)
        row["kv_bytes"] = kv_bytes(config, dtype, batch, args.context_len)
        row["bytes_floor_ms"] = 1e3 * (weight_bytes + row["kv_bytes"]) / (bandwidth * 1e9)
        row["step_over_bytes_floor"] = row["step_ms"] / row["bytes_floor_ms"]
        rows.append(row)
    prefill = None
    if args.prefill_tokens:
        prefill = {"tokens": args.prefill_tokens,
                   **gemm_floor(config, dtype, args.prefill_tokens, args.repeats, logit_rows=1)}
        prefill["step_ms"], ratios = engine_prefill_ms(args, args.prefill_tokens, prefill.pop("calls"))
        prefill["gemm_floor_over_step"] = prefill["gemm_floor_ms"] / prefill["step_ms"]
        prefill["paired_gemm_floor_over_step"] = statistics.median(ratios)
    stream_ms = 1e3 * weight_bytes / (bandwidth * 1e9)
    result = {"cpu": cpu_info(), "model": args.model, "dtype": args.dtype, "num_threads": args.num_threads,
              "context_len": args.context_len, "repeats": args.repeats, "read_bandwidth_gbs": bandwidth,
              "weight_bytes_per_step": weight_bytes, "weight_stream_ms": stream_ms,
              "engine_weight_bytes": engine_bytes, "rows": rows, "prefill": prefill}
    one = next((r for r in rows if r["batch"] == 1), None)
    result["batch1_step_over_stream"] = None if one is None else one["step_ms"] / stream_ms
    result["batch1_paired_step_over_stream"] = None if one is None else one["paired_step_over_stream"]
    return result


def report(result: dict) -> None:
    cpu = result["cpu"]
    flags = " ".join(f"{f}={'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    print(f"CPU: {cpu['model_name']}  {flags}  native bf16 (cpu_has_native_bf16): {cpu['native_bf16']}  "
          f"torch {cpu['torch']} ({cpu['torch_cpu_capability']})")
    print(f"model {result['model']} {result['dtype']}, {result['num_threads']} threads, context {result['context_len']}, "
          f"medians of {result['repeats']}")
    print(f"read bandwidth {result['read_bandwidth_gbs']:.1f} GB/s; the model's weights "
          f"{result['weight_bytes_per_step'] / 2**20:.0f} MiB -> streaming floor {result['weight_stream_ms']:.1f} ms "
          f"(the engine holds {result['engine_weight_bytes'] / 2**20:.0f} MiB of them)")
    paths = list(result["rows"][0]["gemm_ms"])
    print(f"{'batch':>5} " + " ".join(f"{p:>22}" for p in paths) + f" {'floor path':>22} {'step ms':>8} {'step/floor':>10} {'paired':>7}")
    for r in result["rows"]:
        print(f"{r['batch']:>5} " + " ".join(f"{r['gemm_ms'][p]:>22.2f}" for p in paths)
              + f" {r['gemm_floor_path']:>22} {r['step_ms']:>8.2f} {r['step_over_gemm_floor']:>10.2f}"
              f" {r['paired_step_over_gemm_floor']:>7.2f}")
    for r in result["rows"]:
        print(f"batch {r['batch']}: KV read {r['kv_bytes'] / 2**20:.0f} MiB; weights + KV at the read bandwidth "
              f"{r['bytes_floor_ms']:.1f} ms; step / that = {r['step_over_bytes_floor']:.2f}")
    if result["batch1_step_over_stream"] is not None:
        print(f"batch 1: step / weight streaming = {result['batch1_step_over_stream']:.2f} (medians); "
              f"paired {result['batch1_paired_step_over_stream']:.2f}")
    pre = result["prefill"]
    if pre is not None:
        print(f"prefill of {pre['tokens']} tokens: GEMM floor {pre['gemm_floor_ms']:.2f} ms ({pre['gemm_floor_path']}), "
              f"engine step {pre['step_ms']:.2f} ms: the step runs at {100 * pre['gemm_floor_over_step']:.0f}% "
              f"of its GEMM floor (medians), {100 * pre['paired_gemm_floor_over_step']:.0f}% paired")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' or a local HF folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,16,64", type=lambda s: [int(b) for b in s.split(",")])
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--prefill-tokens", type=int, default=512,
                   help="also time a prefill chunk of this many tokens against its GEMM floor (0: skip)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2, help="engine steps before the timed ones")
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="size of the tensor the bandwidth sum reads")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = run(args)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
