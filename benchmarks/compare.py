"""Disaggregated vs colocated serving vs transformers' static batching: one workload, one run.

The same random token-id prompts (`--input-len` in, exactly `--output-len` out with ignore_eos),
model and dtype go through (1) `pdserve serve` with 1 prefill + 1 decode node, (2) `pdserve serve
--colocated` with one node, both load-tested over HTTP by `pdserve bench serve`'s client at every
`--request-rates` rate, and (3) transformers `generate` in static batches of `--max-concurrency`
(offline, all prompts at once: the floor). Threads: each stack node gets `--num-threads` (default:
the cores split between its nodes, as `pdserve serve` does); transformers gets `--hf-num-threads`
(default: all cores). On a busy machine, keep threads at or below the idle cores: oversubscribed
torch threads spin and can run many times slower.

    python -m benchmarks.compare --model smollm2 --dtype bfloat16 --num-prompts 64 \\
        --input-len 256 --output-len 128 --request-rates 1,2,4,inf --max-concurrency 16 --sweep --out results/

Writes OUT/compare.md (the table, also printed), OUT/compare.json (every summary and request),
OUT/compare.png (output tok/s and TTFT p50/p99 per system, at rate inf if it ran, else the first) and, with --sweep,
OUT/compare_sweep.png (throughput, goodput, TTFT p99, TPOT p99 against rate, disagg vs colocated).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path

from pdserve.bench.arrivals import parse_rate
from pdserve.bench.client import EndpointConfig
from pdserve.bench.datasets import SampleRequest, random_requests
from pdserve.bench.json_out import write_json
from pdserve.bench.metrics import parse_slos, summarize
from pdserve.bench.plots import plot_bars, plot_sweep
from pdserve.bench.report import rate_label, run_to_dict
from pdserve.bench.runner import BenchmarkRun, LoadConfig, run_benchmark

SYSTEMS = ("disagg", "colocated", "hf")
PERCENTILES = [50.0, 90.0, 99.0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on GPUs and bf16-native CPUs, else float32 (resolved once for all systems)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rates", default="inf", help="comma-separated req/s; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=16, help="client cap; also transformers' batch size")
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--goodput", "--slo", dest="goodput", nargs="+", default=None, metavar="NAME:MS")
    p.add_argument("--sweep", action="store_true", help="also plot metrics against rate (needs >= 2 rates)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    p.add_argument("--num-threads", type=int, default=None, help="per stack node")
    p.add_argument("--hf-num-threads", type=int, default=None, help="transformers' torch threads (default: all cores)")
    p.add_argument("--serve-args", default="", help="extra `pdserve serve` flags for both stacks")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("compare_results"))
    return p


def resolve_dtype(dtype: str, device: str) -> str:
    from pdserve.engine.config import cpu_has_native_bf16

    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") or cpu_has_native_bf16() else "float32"


def stack_flags(system: str, args: argparse.Namespace, dtype: str) -> tuple[dict, list[str]]:
    """Stack keyword arguments and the serve flags for one system (threads split between its nodes)."""
    num_nodes = 1 if system == "colocated" else 2
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // num_nodes)
    kw = {"colocated": True, "num_nodes": 1} if system == "colocated" else {"num_prefill": 1, "num_decode": 1}
    return kw, ["--dtype", dtype, "--device", args.device, "--num-threads", str(threads), *args.serve_args.split()]


def bench_stack(system: str, args: argparse.Namespace, dtype: str, samples: list[SampleRequest],
                rates: list[float]) -> list[BenchmarkRun]:
    from benchmarks.harness.stack import Stack
    from pdserve.bench.cli import first_model_id

    kw, extra = stack_flags(system, args, dtype)
    print(f"starting {system}: pdserve serve {' '.join(extra)}", flush=True)
    stack = Stack(args.model, extra=extra, timeout=args.ready_timeout, **kw)
    try:
        cfg = EndpointConfig(stack.url + "/v1/completions", first_model_id(stack.url), ignore_eos=True,
                             return_token_ids=True)
        runs = []
        for i, rate in enumerate(rates):
            load = LoadConfig(rate, max_concurrency=args.max_concurrency, seed=args.seed,
                              num_warmups=args.num_warmups if i == 0 else 0)
            runs.append(asyncio.run(run_benchmark(cfg, samples, load, BenchmarkRun())))
        return runs
    finally:
        stack.close()


def bench_hf(args: argparse.Namespace, dtype: str, samples: list[SampleRequest]) -> BenchmarkRun:
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.bench.hf_static import run_static_batches
    from pdserve.engine.loader import resolve_model

    print("starting hf: transformers static batching", flush=True)
    torch.set_num_threads(args.hf_num_threads or os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=getattr(torch, dtype))
    model = model.to(args.device).eval()
    pad = model.generation_config.pad_token_id
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    return run_static_batches(model, samples, args.max_concurrency, pad if pad is not None else 0, sync)


def markdown_table(results: dict[str, list[tuple[BenchmarkRun, dict]]]) -> str:
    rows = ["| system | rate (req/s) | ok / failed | req/s | goodput | out tok/s | TTFT p50 / p99 ms "
            "| TPOT p50 / p99 ms | ITL p50 ms | E2E p50 ms |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for system, runs in results.items():
        for run, s in runs:
            goodput = "-" if s["request_goodput"] is None else f"{s['request_goodput']:.2f}"
            rate = rate_label(run.request_rate) + (" (offline)" if system == "hf" else "")
            rows.append(f"| {system} | {rate} | {s['completed']} / {s['failed']} | {s['request_throughput']:.2f} | "
                        f"{goodput} | {s['output_throughput']:.1f} | {s['median_ttft_ms']:.1f} / "
                        f"{s['p99_ttft_ms']:.1f} | {s['median_tpot_ms']:.2f} / {s['p99_tpot_ms']:.2f} | "
                        f"{s['median_itl_ms']:.2f} | {s['median_e2el_ms']:.1f} |")
    return "\n".join(rows)


def bar_runs(results: dict[str, list[tuple[BenchmarkRun, dict]]]) -> dict[str, tuple[BenchmarkRun, dict]]:
    """Per system, the run the bars show: at rate inf when it ran (like the offline transformers floor),
    else its first rate."""
    return {name: next(((r, s) for r, s in runs if math.isinf(r.request_rate)), runs[0])
            for name, runs in results.items()}


def write_outputs(args: argparse.Namespace, config: dict, results: dict[str, list[tuple[BenchmarkRun, dict]]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results)
    header = (f"{config['model']}, {config['dtype']} on {config['device']}: {config['num_prompts']} prompts of "
              f"{config['input_len']} tokens, {config['output_len']} out, max concurrency {config['max_concurrency']}")
    (args.out / "compare.md").write_text(f"{header}\n\n{table}\n")
    print(f"\n{header}\n\n{table}\n")
    doc = {"config": config, "systems": {name: [run_to_dict(run, s) for run, s in runs]
                                          for name, runs in results.items()}}
    write_json(args.out / "compare.json", doc, indent=1)
    plot_bars({f"{name}\n@ {rate_label(run.request_rate)}": s for name, (run, s) in bar_runs(results).items()},
              args.out / "compare.png")
    if args.sweep:
        served = {name: [(run.request_rate, s) for run, s in runs] for name, runs in results.items() if name != "hf"}
        plot_sweep(served, args.out / "compare_sweep.png")
    print(f"wrote {args.out}/compare.md, compare.json, compare.png" + (", compare_sweep.png" if args.sweep else ""))


def workload(args: argparse.Namespace) -> list[SampleRequest]:
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(resolve_model(args.model)).vocab_size
    return random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, vocab_size=vocab, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rates = [parse_rate(r) for r in args.request_rates.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    if set(systems) - set(SYSTEMS) or (args.sweep and len(rates) < 2):
        raise SystemExit(f"--systems takes {','.join(SYSTEMS)}; --sweep needs at least two --request-rates")
    slos, dtype = parse_slos(args.goodput), resolve_dtype(args.dtype, args.device)
    samples = workload(args)
    results: dict[str, list[tuple[BenchmarkRun, dict]]] = {}
    for system in systems:
        runs = [bench_hf(args, dtype, samples)] if system == "hf" else bench_stack(system, args, dtype, samples, rates)
        results[system] = [(run, summarize(run.records, run.duration_s, PERCENTILES, slos)) for run in runs]
    write_outputs(args, {**vars(args), "dtype": dtype, "rates": rates}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
