"""Does disaggregation pay? Goodput of colocated, split and planned stacks on the same machine.

Systems (two node processes on a 2-core machine, threads split between them, except `colocated`):

    colocated   one node that prefills and decodes (`pdserve serve --colocated`), every core
    split       1 prefill + 1 decode node, every request split (`--disagg-policy always`)
    local       2 decode nodes, every request prefilled where it is decoded (`--disagg-policy never`)
    auto        1 prefill + 1 decode node, `--disagg-policy auto` and the planner (`--planner`):
                per request local or remote, and the nodes' roles chosen for the SLOs

Workloads: `short` (random prompts of --short-in tokens, --short-out out), `long` (--long-in,
--long-out) and `shifting` (pdserve.bench.traces.shifting_trace: chat, summarisation and
generation phases every --shift-period seconds, lengths times --shift-scale).

For every (round, system, workload) a goodput search (pdserve.bench.goodput_search, DistServe's
definition: the highest request rate at which >= 90% of requests meet both --slo-ttft-ms and
--slo-tpot-ms). Systems are interleaved: round r runs them in a rotated order. The table shows the
median over rounds; `validation.json` holds every probe of `split` and `local` (rate, TTFT and
TPOT p50/p90) for the fleet simulator's validation (benchmarks/fleet_sim.py validate).

    python -m benchmarks.disagg_policy --model smollm2 --dtype bfloat16 --rounds 3 --out benchmarks/results/disagg_policy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from pdserve.bench.client import EndpointConfig
from pdserve.bench.datasets import length_requests
from pdserve.bench.goodput_search import search_goodput
from pdserve.bench.metrics import summarize
from pdserve.bench.runner import BenchmarkRun, LoadConfig, run_benchmark
from pdserve.bench.traces import shifting_trace

SYSTEMS = ("colocated", "split", "local", "auto")
WORKLOADS = ("short", "long", "shifting")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=48, help="per probe of the fixed-length workloads")
    p.add_argument("--short-in", type=int, default=128)
    p.add_argument("--short-out", type=int, default=64)
    p.add_argument("--long-in", type=int, default=1024)
    p.add_argument("--long-out", type=int, default=32)
    p.add_argument("--shift-period", type=float, default=20.0)
    p.add_argument("--shift-duration", type=float, default=60.0)
    p.add_argument("--shift-scale", type=float, default=0.25)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=80.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--min-rate", type=float, default=0.25)
    p.add_argument("--max-rate", type=float, default=16.0)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--planner-args", default="--planner-interval 2 --planner-window 15 --planner-cooldown 8")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=Path("disagg_policy_results"))
    return p


def resolve_dtype(dtype: str) -> str:
    from pdserve.engine.config import cpu_has_native_bf16

    return dtype if dtype != "auto" else ("bfloat16" if cpu_has_native_bf16() else "float32")


def start_stack(system: str, args: argparse.Namespace, dtype: str):
    from benchmarks.harness.stack import Stack

    cores = os.cpu_count() or 2
    threads = cores if system == "colocated" else max(1, cores // 2)
    slos = ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
    router = {"colocated": [], "split": ["--disagg-policy", "always"], "local": ["--disagg-policy", "never"],
              "auto": ["--disagg-policy", "auto", "--planner", *slos, *args.planner_args.split()]}[system]
    kw = ({"colocated": True, "num_nodes": 1} if system == "colocated" else
          {"num_prefill": 0, "num_decode": 2} if system == "local" else {"num_prefill": 1, "num_decode": 1})
    extra = ["--dtype", dtype, "--num-threads", str(threads)]
    if router:
        extra.append("--router-args=" + " ".join(router))
    print(f"[{time.strftime('%H:%M:%S')}] starting {system}: {kw} {' '.join(extra)}", flush=True)
    return Stack(args.model, extra=extra, timeout=args.ready_timeout, **kw)


def samples_for(workload: str, rate: float, args: argparse.Namespace, vocab: int):
    """(requests, arrival offsets or None, phase per request or None)."""
    if workload == "shifting":
        trace = shifting_trace(period_s=args.shift_period, rate=rate, duration_s=args.shift_duration,
                               scale=args.shift_scale, seed=1)
        reqs = length_requests([(t.input_len, t.output_len) for t in trace], vocab_size=vocab, seed=1)
        return reqs, [t.arrival_s for t in trace], [t.phase for t in trace]
    n_in, n_out = (args.short_in, args.short_out) if workload == "short" else (args.long_in, args.long_out)
    return length_requests([(n_in, n_out)] * args.num_prompts, vocab_size=vocab, seed=2), None, None


def probe_once(stack, workload: str, rate: float, args: argparse.Namespace, vocab: int, model_id: str) -> dict:
    reqs, offsets, phases = samples_for(workload, rate, args, vocab)
    cfg = EndpointConfig(stack.url + "/v1/completions", model_id, ignore_eos=True, return_token_ids=True)
    load = LoadConfig(rate, offsets=offsets, disable_tqdm=True, seed=3, request_timeout_s=600.0)
    run = asyncio.run(run_benchmark(cfg, reqs, load, BenchmarkRun()))
    slos = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms}
    s = summarize(run.records, run.duration_s, [50.0, 90.0], slos)
    attainment = (s["num_good"] or 0) / max(1, len(run.records))
    return {"rate": rate, "attainment": attainment, "summary": s,
            "nodes": stack.get("/nodes")["nodes"]}


def search(stack, workload: str, args: argparse.Namespace, vocab: int, model_id: str) -> dict:
    probes: list[dict] = []

    def probe(rate: float) -> float:
        p = probe_once(stack, workload, rate, args, vocab, model_id)
        probes.append(p)
        s = p["summary"]
        roles = ",".join(f"{n['role']}" for n in p["nodes"])
        print(f"  {workload} @ {rate:.3g} req/s: attainment {p['attainment']:.2f}, TTFT p90 {s['p90_ttft_ms']:.0f} ms, "
              f"TPOT p90 {s['p90_tpot_ms']:.1f} ms, {s['output_throughput']:.0f} tok/s, roles [{roles}]", flush=True)
        return p["attainment"]

    result = search_goodput(probe, args.min_rate, args.max_rate, args.iters, args.attainment)
    return {"goodput": result.goodput, "status": result.status, "message": result.message, "probes": probes}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    workloads = [w for w in args.workloads.split(",") if w]
    if set(systems) - set(SYSTEMS) or set(workloads) - set(WORKLOADS):
        raise SystemExit(f"--systems takes {','.join(SYSTEMS)}; --workloads takes {','.join(WORKLOADS)}")
    from pdserve.bench.cli import first_model_id
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig

    dtype = resolve_dtype(args.dtype)
    from pdserve.bench.datasets import load_tokenizer, vocab_size_of

    path = resolve_model(args.model)  # random ids the router accepts: the model's and the tokenizer's
    model_vocab = ModelConfig.from_pretrained(path).vocab_size
    vocab = min(model_vocab, vocab_size_of(load_tokenizer(str(path)), model_vocab))
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {s: {w: [] for w in workloads} for s in systems}
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            stack = start_stack(system, args, dtype)
            try:
                model_id = first_model_id(stack.url)
                for workload in workloads:
                    results[system][workload].append(search(stack, workload, args, vocab, model_id))
                    print(f"[round {r}] {system} {workload}: {results[system][workload][-1]['message']}", flush=True)
            finally:
                stack.close()
            (args.out / "disagg_policy.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                                     "dtype": dtype, "results": results}, indent=1))
    write_outputs(args, systems, workloads, results)
    return 0


def write_outputs(args, systems, workloads, results) -> None:
    med = {s: {w: statistics.median(x["goodput"] for x in results[s][w]) for w in workloads} for s in systems}
    lines = [f"goodput (req/s, >= {args.attainment:.0%} of requests within TTFT {args.slo_ttft_ms:g} ms and TPOT "
             f"{args.slo_tpot_ms:g} ms), median of {args.rounds} round(s)", "",
             "| workload | " + " | ".join(systems) + " | auto / best of colocated, split | auto / worse |",
             "| --- |" + " --- |" * (len(systems) + 2)]
    for w in workloads:
        row = [f"{med[s][w]:.3g}" for s in systems]
        ratio = worse = "-"
        if {"auto", "colocated", "split"} <= set(systems):
            best = max(med["colocated"][w], med["split"][w])
            low = min(med["colocated"][w], med["split"][w])
            ratio = f"{med['auto'][w] / best:.2f}" if best else "-"
            worse = f"{med['auto'][w] / low:.2f}" if low else "-"
        lines.append(f"| {w} | " + " | ".join(row) + f" | {ratio} | {worse} |")
    table = "\n".join(lines)
    (args.out / "disagg_policy.md").write_text(table + "\n")
    print("\n" + table)
    validation = []
    for s, split in (("split", (1, 1)), ("local", (0, 2))):
        for w in workloads:
            for res in results.get(s, {}).get(w, []):
                for p in res["probes"]:
                    sm = p["summary"]
                    validation.append({"workload": w, "split": list(split), "load": p["rate"],
                                       "ttft_p50": sm["median_ttft_ms"] / 1e3, "ttft_p90": sm["p90_ttft_ms"] / 1e3,
                                       "tpot_p50": sm["median_tpot_ms"] / 1e3, "tpot_p90": sm["p90_tpot_ms"] / 1e3})
    (args.out / "validation.json").write_text(json.dumps(validation, indent=1))
    try:
        plot(args, systems, workloads, med)
    except ImportError:
        print("matplotlib missing (pdserve[bench]): no plot")


def plot(args, systems, workloads, med) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(systems)
    for i, s in enumerate(systems):
        ax.bar([j + i * width for j in range(len(workloads))], [med[s][w] for w in workloads], width, label=s)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))], workloads)
    ax.set_ylabel("goodput (req/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "disagg_policy.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
