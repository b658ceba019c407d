"""`pdserve bench serve`: load-test any OpenAI-compatible server, as `vllm bench serve` does.

    pdserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 512 --random-output-len 128 --num-prompts 200 --request-rate 4 \\
        --max-concurrency 32 --goodput ttft:500 tpot:50 --save-json out.json --plot plots/

The pieces live in `pdserve/bench/` (datasets, arrivals, client, runner, metrics, report, plots,
chaos); this module parses flags and runs one benchmark per request rate (several with --sweep).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import urllib.request
from pathlib import Path

from pdserve.bench.arrivals import parse_rate
from pdserve.bench.by_length import by_length_table
from pdserve.bench.chaos import ChaosConfig, chaos_report
from pdserve.bench.client import EndpointConfig, auth_headers
from pdserve.bench.datasets import (
    SampleRequest,
    bimodal_requests,
    load_tokenizer,
    parse_output_lens,
    random_requests,
    sharegpt_requests,
    vocab_size_of,
)
from pdserve.bench.json_out import jsonable
from pdserve.bench.metrics import parse_percentiles, parse_slos, summarize
from pdserve.bench.report import print_summary, rate_label, save_json, sweep_table
from pdserve.bench.runner import BenchmarkRun, LoadConfig, run_benchmark

DEFAULT_SWEEP_DIR = "bench_sweep"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", default=None, help="default: the first id from GET /v1/models")
    g.add_argument("--tokenizer", default=None, help="local tokenizer folder: exact token counts, text for chat")
    g.add_argument("--request-timeout", type=float, default=6 * 3600.0, help="seconds per request")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=["random", "sharegpt", "bimodal"], default="random",
                   help="bimodal: random prompts of --random-input-len, outputs short or long (shortest-job-first)")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*[1-r, 1+r]")
    g.add_argument("--random-vocab-size", type=int, default=None,
                   help="random ids are drawn below this (default: the tokenizer's size, else 256)")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="cap on each reply's output length")
    g.add_argument("--bimodal-output-lens", default="16,512", metavar="SHORT,LONG",
                   help="bimodal: the two output lengths (default %(default)s)")
    g.add_argument("--bimodal-long-fraction", type=float, default=0.2, help="bimodal: share of long requests (default 0.2)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s, or inf (default)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for random and bimodal, off for sharegpt")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--return-token-ids", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for vLLM's token_ids in each chunk, so a chunk of k tokens counts as k ITL samples "
                        "(default on; --no-return-token-ids for servers that refuse unknown fields: the final "
                        "usage then gives the token count)")
    g.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into each request")
    g.add_argument("--disable-tqdm", action="store_true")
    g = p.add_argument_group("chaos (nodes on this machine; something must restart them, e.g. pdserve serve)")
    g.add_argument("--chaos-interval", type=float, default=None, metavar="S",
                   help="every S seconds kill -9 a random live node during the run, and report every request's fate")
    g.add_argument("--chaos-roles", default="prefill,decode", help="roles to pick victims from")
    g.add_argument("--chaos-max-faults", type=int, default=None, metavar="N", help="stop after N faults")
    g.add_argument("--chaos-stall", type=float, default=0.0, metavar="S",
                   help="freeze the victim (SIGSTOP) for S seconds instead of killing it")
    g = p.add_argument_group("results")
    g.add_argument("--percentiles", "--metric-percentiles", dest="percentiles", type=parse_percentiles,
                   default=[50.0, 90.0, 99.0], help="comma-separated (default 50,90,99)")
    g.add_argument("--goodput", "--slo", dest="goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs: ttft:MS tpot:MS e2e:MS; goodput counts requests meeting all of them")
    g.add_argument("--save-json", type=Path, default=None, help="summary and every request's measurements")
    g.add_argument("--plot", type=Path, default=None, help="directory for TTFT/TPOT/ITL/E2E CDF PNGs")
    g.add_argument("--sweep", default=None, metavar="RATE1,RATE2,...",
                   help=f"one run per rate, plus sweep.png in --plot (default {DEFAULT_SWEEP_DIR}/)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench", description="benchmarks against a running server")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="load-test an OpenAI-compatible server", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(serve)
    return parser


def first_model_id(base_url: str, timeout: float = 30.0) -> str:
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models", headers=auth_headers())
    with urllib.request.urlopen(req, timeout=timeout) as r:
        data = json.loads(r.read()).get("data") or []
    if not data:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def build_samples(args: argparse.Namespace, tokenizer, is_chat: bool) -> list[SampleRequest]:
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
        samples = sharegpt_requests(args.dataset_path, args.num_prompts, seed=args.seed, tokenizer=tokenizer,
                                    output_len_cap=args.sharegpt_output_len)
        if len(samples) < args.num_prompts:
            print(f"note: {args.dataset_path} has {len(samples)} usable conversations of {args.num_prompts} asked")
        return samples
    vocab = args.random_vocab_size or vocab_size_of(tokenizer, 256)
    if args.dataset_name == "bimodal":
        return bimodal_requests(args.num_prompts, args.random_input_len, parse_output_lens(args.bimodal_output_lens),
                                args.bimodal_long_fraction, vocab_size=vocab, seed=args.seed, as_text=is_chat,
                                tokenizer=tokenizer)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                           vocab_size=vocab, seed=args.seed, as_text=is_chat, tokenizer=tokenizer)


def endpoint_config(args: argparse.Namespace) -> EndpointConfig:
    base = args.base_url or f"http://{args.host}:{args.port}"
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name in ("random", "bimodal")
    return EndpointConfig(api_url=base.rstrip("/") + "/" + args.endpoint.lstrip("/"),
                          model=args.model or first_model_id(base), ignore_eos=ignore_eos,
                          temperature=args.temperature, return_token_ids=args.return_token_ids,
                          extra_body=dict(args.extra_body))


def run_rates(cfg: EndpointConfig, samples: list[SampleRequest], args: argparse.Namespace,
              rates: list[float]) -> list[BenchmarkRun]:
    """One run per rate; Ctrl-C ends the current run (kept, marked interrupted) and skips the rest."""
    runs = []
    for i, rate in enumerate(rates):
        chaos = None
        if args.chaos_interval:
            chaos = ChaosConfig(args.chaos_interval, tuple(args.chaos_roles.split(",")), args.chaos_stall, args.seed,
                                args.chaos_max_faults)
        load = LoadConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                          num_warmups=args.num_warmups if i == 0 else 0, seed=args.seed,
                          disable_tqdm=args.disable_tqdm, request_timeout_s=args.request_timeout, chaos=chaos)
        runs.append(BenchmarkRun(request_rate=rate))
        try:
            asyncio.run(run_benchmark(cfg, samples, load, runs[-1]))
        except KeyboardInterrupt:
            runs[-1].mark_interrupted()
            break
    return runs


def report(args: argparse.Namespace, cfg: EndpointConfig, runs: list[BenchmarkRun]) -> None:
    computed = sorted(set(args.percentiles) | {50.0, 99.0})  # the sweep table and plots read p50/p99
    slos = parse_slos(args.goodput)
    results = [(run, summarize(run.records, run.duration_s, computed, slos)) for run in runs]
    for run, summary in results:
        title = f" Serving Benchmark Result (rate {rate_label(run.request_rate)}) "
        print_summary(summary, title=title, interrupted=run.interrupted, percentiles=args.percentiles)
        if run.chaos is not None:
            print(chaos_report(run.chaos, run.records))
        if args.dataset_name == "bimodal":
            print(by_length_table({f"rate {rate_label(run.request_rate)}": run.records}))
    if len(results) > 1:
        print(sweep_table([(run.request_rate, s) for run, s in results]))
    if args.save_json:
        config = jsonable({**vars(args), "api_url": cfg.api_url, "model": cfg.model, "ignore_eos": cfg.ignore_eos})
        print(f"saved {save_json(args.save_json, config, results)}")
    if args.plot or args.sweep:
        from pdserve.bench.plots import plot_cdfs, plot_sweep
    if args.plot:
        paths = plot_cdfs({f"rate {rate_label(run.request_rate)}": run.records for run, _ in results}, args.plot)
        print("plots: " + ", ".join(map(str, paths)))
    if args.sweep:
        path = plot_sweep({cfg.model: [(run.request_rate, s) for run, s in results]},
                          (args.plot or Path(DEFAULT_SWEEP_DIR)) / "sweep.png")
        print(f"sweep plot: {path}")


def serve(args: argparse.Namespace) -> int:
    parse_slos(args.goodput)  # fail on a bad SLO before sending anything
    if (args.plot or args.sweep) and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("pdserve bench: --plot and --sweep draw with matplotlib, which is not installed: "
                         "pip install 'pdserve[bench]'")
    cfg = endpoint_config(args)
    tokenizer = load_tokenizer(args.tokenizer)
    samples = build_samples(args, tokenizer, cfg.is_chat)
    rates = [parse_rate(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    print(f"{cfg.api_url} model={cfg.model} prompts={len(samples)} rates={','.join(map(rate_label, rates))} "
          f"burstiness={args.burstiness} max_concurrency={args.max_concurrency}", flush=True)
    runs = run_rates(cfg, samples, args, rates)
    report(args, cfg, runs)
    return 130 if any(run.interrupted for run in runs) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return serve(args)
    except (ValueError, OSError) as e:  # bad flags, unreachable server, missing files: a message, no traceback
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
