"""`pdserve bench serve`: load-test any OpenAI-compatible server, as `vllm bench serve` does.

    pdserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 512 --random-output-len 128 --num-prompts 200 --request-rate 4 \\
        --max-concurrency 32 --goodput ttft:500 tpot:50 --save-json out.json --plot plots/

The pieces live in `pdserve/bench/` (datasets, arrivals, client, runner, metrics, report, plots,
chaos, traces, goodput_search); this module parses flags and runs one benchmark per request rate
(several with --sweep), or searches for the goodput:

    pdserve bench serve --dataset-name trace --trace-path benchmarks/traces/azure_synthetic.csv \
        --trace-time-scale 2 --goodput ttft:2000 tpot:200
    pdserve bench serve --dataset-name shifting --shift-period 30 --shift-duration 120 --shift-scale 0.1 \
        --request-rate 2 --goodput ttft:2000 tpot:200
    pdserve bench serve --random-input-len 128 --random-output-len 32 --num-prompts 50 \
        --goodput ttft:1000 tpot:100 --goodput-search --search-min-rate 0.5 --search-max-rate 16

Prefix-cache workloads (their summary adds the prefix hit rate, the oracle's, recomputed tokens and
KV bytes received per request; pdserve/bench/prefix_metrics.py):

    # multi-turn: 32 conversations of 4 turns, 8 in flight, 2 s between a reply and the next turn;
    # turn k+1's prompt = turn k's prompt + its reply + ~60 new tokens (conversations.py)
    pdserve bench serve --dataset-name conversation --num-conversations 32 --conversation-turns 4 \
        --conversation-history-tokens 900 --conversation-new-tokens 60 --random-output-len 64 \
        --think-time 2 --max-concurrency 8
    # agents: 500 requests over 4 shared system prompts of 1024 tokens + 128-token user suffixes
    pdserve bench serve --dataset-name system-prompt --num-prompts 500 --num-system-prompts 4 \
        --system-prompt-len 1024 --random-input-len 128 --random-output-len 32 --request-rate 8
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import urllib.request
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from pdserve.bench.arrivals import parse_rate
from pdserve.bench.by_length import by_length_table
from pdserve.bench.by_phase import by_phase, phase_table
from pdserve.bench.chaos import ChaosConfig, base_url_of, chaos_report
from pdserve.bench.client import EndpointConfig, auth_headers
from pdserve.bench.conversations import ConversationSpec, conversation_specs, run_conversations
from pdserve.bench.datasets import (
    SampleRequest,
    bimodal_requests,
    length_requests,
    load_tokenizer,
    parse_output_lens,
    random_requests,
    sharegpt_requests,
    system_prompt_requests,
    vocab_size_of,
)
from pdserve.bench.fleet_probe import fleet_snapshot
from pdserve.bench.goodput_search import probe_table, result_to_dict, search_goodput
from pdserve.bench.json_out import jsonable
from pdserve.bench.metrics import meets_slos, parse_percentiles, parse_slos, summarize
from pdserve.bench.prefix_metrics import prefix_summary, print_prefix_summary
from pdserve.bench.prefix_oracle import DEFAULT_BLOCK_SIZE
from pdserve.bench.report import print_summary, rate_label, save_json, sweep_table
from pdserve.bench.runner import BenchmarkRun, LoadConfig, run_benchmark
from pdserve.bench.traces import TraceRequest, load_azure_trace, shifting_trace

DEFAULT_SWEEP_DIR = "bench_sweep"
DEFAULT_SEARCH = {"search_min_rate": 0.5, "search_max_rate": 32.0, "search_iters": 5}
DATASETS = ["random", "sharegpt", "bimodal", "trace", "shifting", "conversation", "system-prompt"]
PREFIX_DATASETS = ("conversation", "system-prompt")  # the workloads whose summary has the prefix-cache figures
# Flags whose default depends on the dataset (None in the parser, so that misuse can be told apart).
CONVERSATION_DEFAULTS = {"num_conversations": 100, "conversation_turns": 4, "conversation_history_tokens": 900,
                         "conversation_new_tokens": 60, "think_time": 0.0}
SYSTEM_PROMPT_DEFAULTS = {"num_system_prompts": 4, "system_prompt_len": 1024, "system_prompt_dist": "uniform"}
ORACLE_DEFAULTS = {"oracle_block_size": DEFAULT_BLOCK_SIZE}
DEFAULT_NUM_PROMPTS = 1000
PREFIX_RESEED = 7919  # seed step between the prefix workloads drawn for successive rates
DEFAULT_INPUT_LEN = {"system-prompt": 128}  # else 1024


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
    g.add_argument("--dataset-name", choices=DATASETS, default="random",
                   help="bimodal: random prompts of --random-input-len, outputs short or long (shortest-job-first); "
                        "trace: replay --trace-path's arrivals and lengths; shifting: a request mix that changes "
                        "every --shift-period seconds; conversation: multi-turn conversations, each turn's prompt "
                        "the history + a new message; system-prompt: a few long system prompts shared by many "
                        "users (both report prefix-cache hit rates against an oracle)")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests to send (default {DEFAULT_NUM_PROMPTS}; conversation: --num-conversations)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--random-input-len", type=int, default=None,
                   help="prompt tokens (default 1024); system-prompt: the user suffix after the system prompt "
                        "(default 128)")
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths uniform in len*[1-r, 1+r]")
    g.add_argument("--random-vocab-size", type=int, default=None,
                   help="random ids are drawn below this (default: the tokenizer's size, else 256)")
    g.add_argument("--sharegpt-output-len", type=int, default=None, help="cap on each reply's output length")
    g.add_argument("--bimodal-output-lens", default="16,512", metavar="SHORT,LONG",
                   help="bimodal: the two output lengths (default %(default)s)")
    g.add_argument("--bimodal-long-fraction", type=float, default=0.2, help="bimodal: share of long requests (default 0.2)")
    g.add_argument("--trace-path", type=Path, default=None, metavar="FILE.csv",
                   help="trace: a CSV in the Azure LLM inference trace format (TIMESTAMP,ContextTokens,GeneratedTokens); "
                        "its arrivals replace --request-rate, --num-prompts caps the requests replayed")
    g.add_argument("--trace-time-scale", type=float, default=None, metavar="X",
                   help="trace: multiply the trace's arrival times by X (0.5 replays twice as fast; default 1)")
    g.add_argument("--shift-period", type=float, default=None, metavar="S",
                   help="shifting: seconds per phase; phases chat (1000 in/200 out), summarize (4000/100), "
                        "generate (200/1000) cycle; arrivals at --request-rate with --burstiness")
    g.add_argument("--shift-duration", type=float, default=None, metavar="S", help="shifting: seconds of arrivals")
    g.add_argument("--shift-scale", type=float, default=None, metavar="X",
                   help="shifting: multiply the phases' token lengths by X (e.g. 0.1 on a small CPU; default 1)")
    g = p.add_argument_group("conversation (--dataset-name conversation; pdserve/bench/conversations.py)")
    g.add_argument("--num-conversations", type=int, default=None, metavar="N",
                   help=f"conversations to run (default {CONVERSATION_DEFAULTS['num_conversations']}); each sends "
                        "--conversation-turns requests; --request-rate is conversation starts per second and "
                        "--max-concurrency the conversations in flight")
    g.add_argument("--conversation-turns", type=int, default=None, metavar="K",
                   help=f"turns per conversation (default {CONVERSATION_DEFAULTS['conversation_turns']})")
    g.add_argument("--conversation-history-tokens", type=int, default=None, metavar="N",
                   help="tokens of the first turn's prompt, random as the random dataset's "
                        f"(default {CONVERSATION_DEFAULTS['conversation_history_tokens']})")
    g.add_argument("--conversation-new-tokens", type=int, default=None, metavar="N",
                   help="tokens of the new user message each later turn appends after the history and the reply "
                        f"(default {CONVERSATION_DEFAULTS['conversation_new_tokens']}); replies ask for "
                        "--random-output-len tokens, lengths vary with --random-range-ratio")
    g.add_argument("--think-time", type=float, default=None, metavar="S",
                   help="seconds between a reply's end and the conversation's next turn (default 0)")
    g = p.add_argument_group("system prompts (--dataset-name system-prompt: agents, many users, few prompts)")
    g.add_argument("--num-system-prompts", type=int, default=None, metavar="S",
                   help=f"distinct system prompts (default {SYSTEM_PROMPT_DEFAULTS['num_system_prompts']}); each "
                        "request is one of them + a random user suffix of --random-input-len tokens")
    g.add_argument("--system-prompt-len", type=int, default=None, metavar="N",
                   help=f"tokens per system prompt (default {SYSTEM_PROMPT_DEFAULTS['system_prompt_len']})")
    g.add_argument("--system-prompt-dist", choices=["uniform", "zipf", "round-robin"], default=None,
                   help="which system prompt a request gets: seeded uniform draws (default), zipf (prompt i "
                        "with weight 1/(i+1)) or round-robin")
    g = p.add_argument_group("prefix oracle (conversation and system-prompt; pdserve/bench/prefix_oracle.py)")
    g.add_argument("--oracle-cache-blocks", type=int, default=None, metavar="N",
                   help="capacity of the oracle's one pooled LRU prefix cache, in blocks (default: the sum of "
                        "num_total_blocks over the router's GET /nodes; unbounded when there is no /nodes)")
    g.add_argument("--oracle-block-size", type=int, default=None, metavar="N",
                   help=f"tokens per block of the oracle's cache, the engine's block size (default {DEFAULT_BLOCK_SIZE})")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=parse_rate, default=math.inf, help="requests/s, or inf (default)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, default=None)
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="default: on for every dataset but sharegpt (their lengths are given), off for sharegpt")
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
    g = p.add_argument_group("goodput search (DistServe: the highest rate at which enough requests meet the SLOs)")
    g.add_argument("--goodput-search", action="store_true",
                   help="find the highest request rate at which --goodput-attainment of requests meet every "
                        "--goodput SLO (ttft and tpot required); each probe is a full run of --num-prompts")
    g.add_argument("--goodput-attainment", type=float, default=None, metavar="F",
                   help="share of requests that must meet the SLOs (default 0.9)")
    g.add_argument("--search-min-rate", type=float, default=None, metavar="R",
                   help=f"first rate probed (default {DEFAULT_SEARCH['search_min_rate']:g})")
    g.add_argument("--search-max-rate", type=float, default=None, metavar="R",
                   help=f"highest rate probed; doubling from the min stops here (default {DEFAULT_SEARCH['search_max_rate']:g})")
    g.add_argument("--search-iters", type=int, default=None, metavar="N",
                   help=f"bisection steps after bracketing (default {DEFAULT_SEARCH['search_iters']})")


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
    if args.dataset_name == "system-prompt":
        samples, _ = system_prompt_requests(args.num_prompts, args.num_system_prompts, args.system_prompt_len,
                                            args.random_input_len, args.random_output_len, args.random_range_ratio,
                                            vocab_size=vocab, seed=args.seed, dist=args.system_prompt_dist,
                                            as_text=is_chat, tokenizer=tokenizer)
        return samples
    if args.dataset_name == "bimodal":
        return bimodal_requests(args.num_prompts, args.random_input_len, parse_output_lens(args.bimodal_output_lens),
                                args.bimodal_long_fraction, vocab_size=vocab, seed=args.seed, as_text=is_chat,
                                tokenizer=tokenizer)
    return random_requests(args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio,
                           vocab_size=vocab, seed=args.seed, as_text=is_chat, tokenizer=tokenizer)


def endpoint_config(args: argparse.Namespace) -> EndpointConfig:
    base = args.base_url or f"http://{args.host}:{args.port}"
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name != "sharegpt"
    return EndpointConfig(api_url=base.rstrip("/") + "/" + args.endpoint.lstrip("/"),
                          model=args.model or first_model_id(base), ignore_eos=ignore_eos,
                          temperature=args.temperature, return_token_ids=args.return_token_ids,
                          extra_body=dict(args.extra_body))


@dataclass
class Workload:
    """What one run sends: the requests, and for a trace or the shifting workload their arrival
    offsets and phases (None: arrivals drawn from the rate, no phases)."""

    samples: list[SampleRequest]
    offsets: list[float] | None = None
    phases: list[str] | None = None
    conversations: list[ConversationSpec] | None = None  # the conversation workload (samples is then empty)
    warmups: list[SampleRequest] | None = None  # what warm-ups send (None: the samples)
    tokenizer: object = None

    @property
    def num_requests(self) -> int:
        return sum(c.num_turns for c in self.conversations) if self.conversations is not None else len(self.samples)


def trace_workload(args: argparse.Namespace, requests: list[TraceRequest], tokenizer, is_chat: bool,
                   what: str) -> Workload:
    if len(requests) > args.num_prompts:
        print(f"note: {what} has {len(requests)} requests; --num-prompts {args.num_prompts} keeps the first "
              f"{args.num_prompts} (to {requests[args.num_prompts - 1].arrival_s:.1f} s)", flush=True)
        requests = requests[:args.num_prompts]
    vocab = args.random_vocab_size or vocab_size_of(tokenizer, 256)
    samples = length_requests([(r.input_len, r.output_len) for r in requests], vocab_size=vocab, seed=args.seed,
                              as_text=is_chat, tokenizer=tokenizer)
    phases = [r.phase for r in requests] if any(r.phase for r in requests) else None
    return Workload(samples, [r.arrival_s for r in requests], phases)


def workload_source(args: argparse.Namespace, tokenizer, is_chat: bool):
    """rate → Workload. Datasets without arrival times are built once and reused at every rate; the
    shifting workload is drawn anew per rate; a trace is fixed (its own arrivals)."""
    if args.dataset_name == "trace":
        work = trace_workload(args, load_azure_trace(args.trace_path, time_scale=args.trace_time_scale or 1.0),
                              tokenizer, is_chat, str(args.trace_path))
        return lambda rate: work
    if args.dataset_name == "shifting":
        drawn: dict[float, Workload] = {}

        def shifting(rate: float) -> Workload:
            if rate in drawn:
                return drawn[rate]
            requests = shifting_trace(period_s=args.shift_period, rate=rate, duration_s=args.shift_duration,
                                      burstiness=args.burstiness, seed=args.seed, range_ratio=args.random_range_ratio,
                                      scale=args.shift_scale or 1.0)
            if not requests:
                raise ValueError("the shifting workload has no requests")
            drawn[rate] = trace_workload(args, requests, tokenizer, is_chat, f"the shifting workload at {rate:g} req/s")
            return drawn[rate]
        return shifting
    if args.dataset_name in PREFIX_DATASETS:
        # A fresh draw per rate (the first with --seed itself): a later rate of a sweep or a later probe
        # of the goodput search must not find the earlier runs' prompts in the prefix cache.
        prefix_drawn: dict[float, Workload] = {}

        def prefix(rate: float) -> Workload:
            if rate not in prefix_drawn:
                seed = args.seed + PREFIX_RESEED * len(prefix_drawn)
                prefix_drawn[rate] = prefix_workload(argparse.Namespace(**{**vars(args), "seed": seed}), tokenizer,
                                                     is_chat)
            return prefix_drawn[rate]
        return prefix
    work = Workload(build_samples(args, tokenizer, is_chat))
    return lambda rate: work


def prefix_workload(args: argparse.Namespace, tokenizer, is_chat: bool) -> Workload:
    """The conversation or system-prompt workload; its warm-ups are unrelated random prompts (another
    seed), so that they leave nothing in the prefix cache the run measures."""
    vocab = args.random_vocab_size or vocab_size_of(tokenizer, 256)
    as_text = is_chat or not args.return_token_ids
    warm_len = args.conversation_history_tokens if args.dataset_name == "conversation" else args.random_input_len
    warmups = random_requests(max(1, args.num_warmups), warm_len, args.random_output_len, 0.0, vocab_size=vocab,
                              seed=args.seed + 1_000_003, as_text=is_chat, tokenizer=tokenizer)
    if args.dataset_name == "system-prompt":
        return Workload(build_samples(args, tokenizer, is_chat), warmups=warmups, tokenizer=tokenizer)
    specs = conversation_specs(args.num_conversations, args.conversation_turns, args.conversation_history_tokens,
                               args.conversation_new_tokens, args.random_output_len, args.random_range_ratio,
                               vocab_size=vocab, seed=args.seed, as_text=as_text, tokenizer=tokenizer)
    return Workload([], conversations=specs, warmups=warmups, tokenizer=tokenizer)


def trace_rate(offsets: list[float]) -> float:
    """A trace's mean arrival rate, the label of its run (inf when every request arrives at once)."""
    span = max(offsets) - min(offsets) if offsets else 0.0
    return (len(offsets) - 1) / span if span > 0 else math.inf


def run_one(cfg: EndpointConfig, work: Workload, args: argparse.Namespace, rate: float, first: bool) -> BenchmarkRun:
    """One benchmark; Ctrl-C ends it (the run is kept, marked interrupted)."""
    chaos = None
    if args.chaos_interval:
        chaos = ChaosConfig(args.chaos_interval, tuple(args.chaos_roles.split(",")), args.chaos_stall, args.seed,
                            args.chaos_max_faults)
    if args.dataset_name == "trace":
        rate = trace_rate(work.offsets)
    load = LoadConfig(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                      num_warmups=args.num_warmups if first else 0, seed=args.seed,
                      disable_tqdm=args.disable_tqdm, request_timeout_s=args.request_timeout, chaos=chaos,
                      offsets=work.offsets, warmup_samples=work.warmups)
    prefix = args.dataset_name in PREFIX_DATASETS
    if prefix:  # the fleet's KV counters after the warm-ups, before the timed run
        load.probe = partial(fleet_snapshot, base_url_of(cfg.api_url))
    run = BenchmarkRun(request_rate=rate)
    try:
        if work.conversations is not None:
            asyncio.run(run_conversations(cfg, work.conversations, load, run, args.think_time, work.tokenizer))
        else:
            asyncio.run(run_benchmark(cfg, work.samples, load, run))
    except KeyboardInterrupt:
        run.mark_interrupted()
    if prefix and run.fleet is not None:
        try:
            run.fleet = (run.fleet[0], fleet_snapshot(base_url_of(cfg.api_url)))
        except KeyboardInterrupt:
            pass
    return run


def run_rates(cfg: EndpointConfig, workload_for, args: argparse.Namespace,
              rates: list[float]) -> list[tuple[BenchmarkRun, Workload]]:
    """One run per rate; Ctrl-C ends the current run (kept, marked interrupted) and skips the rest."""
    runs = []
    for i, rate in enumerate(rates):
        work = workload_for(rate)
        runs.append((run_one(cfg, work, args, rate, i == 0), work))
        if runs[-1][0].interrupted:
            break
    return runs


def report(args: argparse.Namespace, cfg: EndpointConfig, runs: list[tuple[BenchmarkRun, Workload]], *,
           quiet: bool = False, extra: dict | None = None) -> None:
    """Print each run's summary (not with `quiet`: the goodput search prints its own table), the
    per-phase table of a shifting workload, the sweep table; save the JSON (with `extra` at its top
    level) and the plots."""
    computed = sorted(set(args.percentiles) | {50.0, 99.0})  # the sweep table and plots read p50/p99
    slos = parse_slos(args.goodput)
    results = []
    for run, work in runs:
        summary = summarize(run.records, run.duration_s, computed, slos)
        if work.phases is not None:
            summary["phases"] = by_phase(run.records, work.phases, slos)
        if args.dataset_name in PREFIX_DATASETS:
            before = run.fleet[0] if run.fleet else None
            blocks = args.oracle_cache_blocks if args.oracle_cache_blocks is not None else (
                before.cache_blocks if before is not None else None)
            summary.update(prefix_summary(run.records, computed, conversation=work.conversations is not None,
                                          fleet=run.fleet, oracle_cache_blocks=blocks,
                                          oracle_block_size=args.oracle_block_size))
        results.append((run, summary))
        if quiet:
            continue
        title = f" Serving Benchmark Result (rate {rate_label(run.request_rate)}) "
        print_summary(summary, title=title, interrupted=run.interrupted, percentiles=args.percentiles)
        if "prefix_hit_rate" in summary:
            print_prefix_summary(summary)
        if "phases" in summary:
            print(f"per phase (rate {rate_label(run.request_rate)}):")
            print(phase_table(summary["phases"]))
        if run.chaos is not None:
            print(chaos_report(run.chaos, run.records))
        if args.dataset_name == "bimodal":
            print(by_length_table({f"rate {rate_label(run.request_rate)}": run.records}))
    if len(results) > 1 and not quiet:
        print(sweep_table([(run.request_rate, s) for run, s in results]))
    if args.save_json:
        config = jsonable({**vars(args), "api_url": cfg.api_url, "model": cfg.model, "ignore_eos": cfg.ignore_eos})
        print(f"saved {save_json(args.save_json, config, results, extra=extra)}")
    if args.plot or args.sweep:
        from pdserve.bench.plots import plot_cdfs, plot_sweep
    if args.plot:
        paths = plot_cdfs({f"rate {rate_label(run.request_rate)}": run.records for run, _ in results}, args.plot)
        print("plots: " + ", ".join(map(str, paths)))
    if args.sweep:
        path = plot_sweep({cfg.model: [(run.request_rate, s) for run, s in results]},
                          (args.plot or Path(DEFAULT_SWEEP_DIR)) / "sweep.png")
        print(f"sweep plot: {path}")


class _SearchInterrupted(Exception):
    pass


def goodput_search(args: argparse.Namespace, cfg: EndpointConfig, workload_for) -> int:
    """Bracket and bisect the request rate (goodput_search.py); every probe is a full run."""
    slos = parse_slos(args.goodput)
    target = args.goodput_attainment if args.goodput_attainment is not None else 0.9
    runs: list[tuple[BenchmarkRun, Workload]] = []
    figures: dict[float, dict] = {}

    def probe(rate: float) -> float:
        work = workload_for(rate)
        run = run_one(cfg, work, args, rate, not runs)
        runs.append((run, work))
        if run.interrupted:
            raise _SearchInterrupted
        attainment = sum(meets_slos(r, slos) for r in run.records) / len(work.samples)
        figures[rate] = summarize(run.records, run.duration_s, [90.0], slos)
        print(f"probe {rate:g} req/s: {attainment:.1%} of {len(work.samples)} requests meet the SLOs "
              f"({'pass' if attainment >= target else 'fail'}), {figures[rate]['request_throughput']:.2f} req/s "
              f"completed", flush=True)
        return attainment

    slo_text = " ".join(f"{k}:{v:g}" for k, v in slos.items())
    try:
        result = search_goodput(probe, args.search_min_rate, args.search_max_rate, args.search_iters, target)
    except _SearchInterrupted:
        print(f"goodput search interrupted after {len(runs)} probes: no answer")
        report(args, cfg, runs, quiet=True)
        return 130
    print(f"{' Goodput search ':=^50}")
    print(f"SLOs {slo_text}, attainment target {target:.0%}")
    print(probe_table(result, figures))
    print(result.message)
    report(args, cfg, runs, quiet=True, extra={"goodput_search": {**result_to_dict(result), "slos_ms": slos}})
    return 0


def serve(args: argparse.Namespace) -> int:
    parse_slos(args.goodput)  # fail on a bad SLO before sending anything
    if (args.plot or args.sweep) and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("pdserve bench: --plot and --sweep draw with matplotlib, which is not installed: "
                         "pip install 'pdserve[bench]'")
    cfg = endpoint_config(args)
    tokenizer = load_tokenizer(args.tokenizer)
    workload_for = workload_source(args, tokenizer, cfg.is_chat)
    if args.goodput_search:
        print(f"{cfg.api_url} model={cfg.model} goodput search over {args.search_min_rate:g}..."
              f"{args.search_max_rate:g} req/s, {args.search_iters} bisection steps, burstiness={args.burstiness} "
              f"max_concurrency={args.max_concurrency}", flush=True)
        return goodput_search(args, cfg, workload_for)
    rates = [parse_rate(r) for r in args.sweep.split(",")] if args.sweep else [args.request_rate]
    work = workload_for(rates[0])
    label = "trace" if args.dataset_name == "trace" else ",".join(map(rate_label, rates))
    what = f"prompts={work.num_requests}"
    if work.conversations is not None:
        what = (f"conversations={len(work.conversations)} turns={args.conversation_turns} "
                f"think_time={args.think_time:g}s requests={work.num_requests}")
    print(f"{cfg.api_url} model={cfg.model} {what} rates={label} "
          f"burstiness={args.burstiness} max_concurrency={args.max_concurrency}", flush=True)
    runs = run_rates(cfg, workload_for, args, rates)
    report(args, cfg, runs)
    return 130 if any(run.interrupted for run, _ in runs) else 0


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flag combinations that cannot work: one argparse error line (exit 2), nothing sent."""
    def given(*names: str) -> list[str]:
        return ["--" + n.replace("_", "-") for n in names if getattr(args, n) is not None]

    trace_flags, shift_flags = given("trace_path", "trace_time_scale"), given("shift_period", "shift_duration",
                                                                             "shift_scale")
    search_flags = given("goodput_attainment", "search_min_rate", "search_max_rate", "search_iters")
    check_prefix_args(parser, args, given)
    if args.num_prompts < 1:
        parser.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset_name != "trace" and trace_flags:
        parser.error(f"{', '.join(trace_flags)}: only with --dataset-name trace")
    if args.dataset_name != "shifting" and shift_flags:
        parser.error(f"{', '.join(shift_flags)}: only with --dataset-name shifting")
    if not args.goodput_search and search_flags:
        parser.error(f"{', '.join(search_flags)}: only with --goodput-search")
    if args.dataset_name == "trace":
        if args.trace_path is None:
            parser.error("--dataset-name trace needs --trace-path FILE.csv")
        if args.trace_time_scale is not None and not (0 < args.trace_time_scale < math.inf):
            parser.error(f"--trace-time-scale must be a number > 0, got {args.trace_time_scale:g}")
        for flag, bad in (("--request-rate", not math.isinf(args.request_rate)), ("--sweep", args.sweep),
                          ("--goodput-search", args.goodput_search)):
            if bad:
                parser.error(f"{flag} does not apply to --dataset-name trace: the trace sets the arrivals "
                             "(use --trace-time-scale to replay it faster or slower)")
    if args.dataset_name == "shifting":
        if args.shift_period is None or args.shift_duration is None:
            parser.error("--dataset-name shifting needs --shift-period S and --shift-duration S")
        for flag, value in (("--shift-period", args.shift_period), ("--shift-duration", args.shift_duration),
                            ("--shift-scale", args.shift_scale)):
            if value is not None and not (0 < value < math.inf):
                parser.error(f"{flag} must be a number > 0, got {value:g}")
        if math.isinf(args.request_rate) and not args.goodput_search:
            parser.error("--dataset-name shifting needs a finite --request-rate (or --sweep / --goodput-search)")
    if args.goodput_search:
        for flag, bad in (("--sweep", args.sweep), ("--request-rate", not math.isinf(args.request_rate))):
            if bad:
                parser.error(f"--goodput-search picks the request rates itself; drop {flag}")
        try:
            slos = parse_slos(args.goodput)
        except ValueError as e:
            parser.error(str(e))
        if "ttft" not in slos or "tpot" not in slos:
            parser.error("--goodput-search needs both SLOs: --goodput ttft:MS tpot:MS")
        for name, value in DEFAULT_SEARCH.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        if not (0 < args.search_min_rate <= args.search_max_rate < math.inf):
            parser.error(f"--search-min-rate and --search-max-rate need 0 < min <= max < inf, got "
                         f"{args.search_min_rate:g} and {args.search_max_rate:g}")
        if args.search_iters < 0:
            parser.error(f"--search-iters must be >= 0, got {args.search_iters}")
        if args.goodput_attainment is not None and not 0 < args.goodput_attainment <= 1:
            parser.error(f"--goodput-attainment must be in (0, 1], got {args.goodput_attainment:g}")


def check_prefix_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given) -> None:
    """The conversation, system-prompt and oracle flags: only with their datasets, in range; then the
    dataset-dependent defaults are filled in (--num-prompts, --random-input-len and these flags)."""
    name = args.dataset_name
    groups = ((CONVERSATION_DEFAULTS, name == "conversation", "conversation"),
              (SYSTEM_PROMPT_DEFAULTS, name == "system-prompt", "system-prompt"),
              (ORACLE_DEFAULTS | {"oracle_cache_blocks": None}, name in PREFIX_DATASETS, "conversation or system-prompt"))
    for defaults, applies, dataset in groups:
        wrong = given(*defaults)
        if wrong and not applies:
            parser.error(f"{', '.join(wrong)}: only with --dataset-name {dataset}")
    if name == "conversation":
        for flag in given("num_prompts", "random_input_len"):
            parser.error(f"{flag} does not apply to --dataset-name conversation: use --num-conversations, "
                         "--conversation-history-tokens and --conversation-new-tokens")
        for flag, bad in (("--goodput-search", args.goodput_search), ("--chaos-interval", args.chaos_interval)):
            if bad:
                parser.error(f"{flag} is not supported with --dataset-name conversation")
    for defaults, applies, _ in groups:
        for key, value in defaults.items():
            if getattr(args, key) is None and applies:
                setattr(args, key, value)
    if args.num_prompts is None:
        args.num_prompts = DEFAULT_NUM_PROMPTS
    if args.random_input_len is None:
        args.random_input_len = DEFAULT_INPUT_LEN.get(name, 1024)
    checks = [("--random-input-len", args.random_input_len, 1), ("--random-output-len", args.random_output_len, 1)]
    if name == "conversation":
        checks += [("--num-conversations", args.num_conversations, 1), ("--conversation-turns", args.conversation_turns, 1),
                   ("--conversation-history-tokens", args.conversation_history_tokens, 1),
                   ("--conversation-new-tokens", args.conversation_new_tokens, 1)]
        if not 0 <= args.think_time < math.inf:
            parser.error(f"--think-time must be a number of seconds >= 0, got {args.think_time:g}")
    if name == "system-prompt":
        checks += [("--num-system-prompts", args.num_system_prompts, 1),
                   ("--system-prompt-len", args.system_prompt_len, 1)]
    if name in PREFIX_DATASETS:
        checks += [("--oracle-block-size", args.oracle_block_size, 1), ("--oracle-cache-blocks",
                                                                        args.oracle_cache_blocks, 0)]
    for flag, value, low in checks:
        if value is not None and value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_args(parser, args)
    try:
        return serve(args)
    except (ValueError, OSError) as e:  # bad flags, unreachable server, missing files: a message, no traceback
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
