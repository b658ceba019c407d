"""First come, first served against shortest job first, one bimodal workload, interleaved rounds.

The same requests (random token-id prompts of `--input-len`; each asks for the short or, with
probability `--long-fraction`, the long output of `--output-lens`, exactly, with ignore_eos) and
the same Poisson arrival times go to one `pdserve serve` stack per policy (`--policies`), load-tested
over HTTP by `pdserve bench serve`'s client.

A machine's speed drifts over minutes by more than the policy changes latency, so the policies are
not run one after the other: every stack is up for the whole run and `--rounds` rounds alternate
their order (A B, B A, A B, ...), so a drift that is linear in time cancels. Each round has its own
requests (a new seed: no prompt repeats, so no prefix-cache hit favours a later run) and both
policies get that round's requests and arrivals. The report gives, per round, each policy's mean /
p50 E2E against the first policy's, and the steady time per output token (after the second token)
as the drift check: a policy reorders queues, it does not change a decode step's cost. Queue wait
is reported apart: TTFT (the prefill queue and the prefill) and the gap to the second token (the
decode node's queue and the KV hand-off), against the steady per-token time.

Shortest job first only reorders a queue, so the stack needs one: the batch must fill up. The
decode node's `--max-num-seqs` (`--decode-args`, default 8 here) caps it; the arrival rate must be
near what the stack can serve. `--request-rate auto` (the default) measures that first: a burst
of `--calibration-prompts` requests (of their own, not reused later) at once on the first policy's
stack gives its request throughput, and the run goes at `--load` times it.

    python -m benchmarks.sjf --model smollm2 --num-prompts 50 --rounds 3 --input-len 128 \\
        --output-lens 16,384 --long-fraction 0.2 --load 1.0 --decode-args "--max-num-seqs 8" \\
        --sjf-aging-s 30 --out results/sjf

Writes OUT/sjf.md (the tables, also printed) and OUT/sjf.json (every round's summaries and requests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import statistics
import sys
from pathlib import Path

from pdserve.bench.arrivals import parse_rate
from pdserve.bench.by_length import by_length_table, e2e_by_output_len, e2e_stats
from pdserve.bench.client import EndpointConfig
from pdserve.bench.datasets import SampleRequest, bimodal_requests, parse_output_lens
from pdserve.bench.json_out import write_json
from pdserve.bench.metrics import summarize
from pdserve.bench.report import rate_label, run_to_dict
from pdserve.bench.request_record import RequestRecord
from pdserve.bench.runner import BenchmarkRun, LoadConfig, run_benchmark
from pdserve.engine.scheduling_policy import SCHEDULING_POLICIES

PERCENTILES = [50.0, 99.0]


def rate_or_auto(text: str) -> str | float:
    if text == "auto":
        return text
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e} (or auto)") from None


def policy_list(text: str) -> list[str]:
    policies = [p for p in text.split(",") if p]
    unknown = [p for p in policies if p not in SCHEDULING_POLICIES]
    if not policies or unknown:
        raise argparse.ArgumentTypeError(f"policies are from {', '.join(SCHEDULING_POLICIES)}, got {text!r}")
    return policies


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--policies", type=policy_list, default="fcfs,sjf",
                   help="comma-separated scheduling policies; the first is the baseline of the ratios")
    p.add_argument("--num-prompts", type=int, default=100, help="requests per round (each policy gets them all)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds; policy order alternates between rounds (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-lens", default="16,512", metavar="SHORT,LONG")
    p.add_argument("--long-fraction", type=float, default=0.2)
    p.add_argument("--request-rate", type=rate_or_auto, default="auto",
                   help="req/s, or auto: --load x the measured throughput")
    p.add_argument("--load", type=float, default=0.9, help="auto rate: this share of the measured throughput")
    p.add_argument("--calibration-prompts", type=int, default=48, help="auto rate: the burst that measures it")
    p.add_argument("--sjf-length-factor", type=float, default=1.0)
    p.add_argument("--sjf-aging-s", type=float, default=30.0)
    p.add_argument("--colocated", action="store_true", help="one colocated node instead of 1 prefill + 1 decode")
    p.add_argument("--prefill-args", default="", help="`pdserve prefill` flags (with --colocated: the node's)")
    p.add_argument("--decode-args", default="--max-num-seqs 8", help="`pdserve decode` flags (default: %(default)s)")
    p.add_argument("--serve-args", default="", help="extra `pdserve serve` flags for every stack")
    p.add_argument("--num-warmups", type=int, default=2)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("sjf_results"))
    return p


class PolicyStack:
    """One `pdserve serve` stack running `policy`; a context manager."""

    def __init__(self, args: argparse.Namespace, policy: str) -> None:
        from benchmarks.harness.stack import Stack
        from pdserve.bench.cli import first_model_id

        extra = ["--dtype", args.dtype, "--scheduling-policy", policy, "--sjf-length-factor",
                 str(args.sjf_length_factor), "--sjf-aging-s", str(args.sjf_aging_s), *args.serve_args.split()]
        node_args = args.prefill_args
        if args.colocated:  # the node prefills and decodes: it takes the decode node's cap too
            node_args = f"{args.prefill_args} {args.decode_args}"
        print(f"starting {policy}: pdserve serve {' '.join(extra)}", flush=True)
        self.stack = Stack(args.model, extra=extra, colocated=args.colocated, prefill_args=node_args,
                           decode_args=args.decode_args, timeout=args.ready_timeout)
        self.cfg = EndpointConfig(self.stack.url + "/v1/completions", first_model_id(self.stack.url), ignore_eos=True)

    def run(self, samples: list[SampleRequest], rate: float, seed: int) -> BenchmarkRun:
        load = LoadConfig(rate, seed=seed)
        return asyncio.run(run_benchmark(self.cfg, samples, load, BenchmarkRun()))

    def __enter__(self) -> PolicyStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()


def calibrate(stack: PolicyStack, args: argparse.Namespace) -> float:
    """--load x the request throughput of a burst of requests of their own (seed -1: never reused)."""
    burst = workload(args, seed=args.seed - 1)[:args.calibration_prompts]
    run = stack.run(burst, math.inf, args.seed)
    throughput = summarize(run.records, run.duration_s, PERCENTILES)["request_throughput"]
    rate = args.load * throughput
    print(f"calibration: {len(burst)} requests at once -> {throughput:.3f} req/s; running at {rate:.3f} req/s",
          flush=True)
    return rate


def workload(args: argparse.Namespace, seed: int) -> list[SampleRequest]:
    from pdserve.bench.datasets import load_tokenizer
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(resolve_model(args.model)).vocab_size
    tokenizer = load_tokenizer(args.model)
    if tokenizer is not None:  # the router refuses ids its tokenizer does not know
        vocab = min(vocab, len(tokenizer))
    return bimodal_requests(args.num_prompts, args.input_len, parse_output_lens(args.output_lens), args.long_fraction,
                            vocab_size=vocab, seed=seed)


def steady_tpot_s(r: RequestRecord) -> float | None:
    """Seconds per output token after the second one: the decode speed, without any queue wait."""
    if not r.success or r.output_len <= 2 or not r.itl_s:
        return None
    return (r.e2el_s - r.ttft_s - r.itl_s[0]) / (r.output_len - 2)


def wait_table(pooled: dict[str, list[RequestRecord]]) -> str:
    """Queue wait apart from decode time, per policy and request class (means, ms)."""
    rows = ["| policy | requests | n | mean TTFT ms | mean gap to 2nd token ms | p50 steady TPOT ms |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for policy, records in pooled.items():
        ok = [r for r in records if r.success]
        for max_tokens in [None, *sorted({r.max_tokens for r in ok})]:
            group = [r for r in ok if max_tokens is None or r.max_tokens == max_tokens]
            gaps = [r.itl_s[0] for r in group if r.itl_s]
            tpots = [t for t in map(steady_tpot_s, group) if t is not None]
            rows.append(f"| {policy} | {'all' if max_tokens is None else f'max_tokens={max_tokens}'} | {len(group)} | "
                        f"{_mean_ms([r.ttft_s for r in group]):.0f} | {_mean_ms(gaps):.0f} | "
                        f"{statistics.median(tpots) * 1000 if tpots else 0.0:.1f} |")
    return "\n".join(rows)


def _mean_ms(values: list[float]) -> float:
    return statistics.fmean(values) * 1000 if values else 0.0


def round_ratios(rounds: list[dict[str, BenchmarkRun]], policies: list[str]) -> list[dict]:
    """Per round and policy after the first: mean, p50 E2E and p50 steady TPOT over the first policy's."""
    base = policies[0]
    out = []
    for i, runs in enumerate(rounds):
        stats = {p: e2e_stats(run.records) for p, run in runs.items()}
        tpot = {p: statistics.median([t for t in map(steady_tpot_s, run.records) if t is not None] or [0.0])
                for p, run in runs.items()}
        for p in policies[1:]:
            out.append({"round": i + 1, "order": list(runs), "policy": p, "baseline": base,
                        "mean_e2el_s": (stats[base]["mean_e2el_ms"] / 1000, stats[p]["mean_e2el_ms"] / 1000),
                        "p50_e2el_s": (stats[base]["p50_e2el_ms"] / 1000, stats[p]["p50_e2el_ms"] / 1000),
                        "mean_ratio": _ratio(stats[p]["mean_e2el_ms"], stats[base]["mean_e2el_ms"]),
                        "p50_ratio": _ratio(stats[p]["p50_e2el_ms"], stats[base]["p50_e2el_ms"]),
                        "steady_tpot_ratio": _ratio(tpot[p], tpot[base])})
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def ratio_table(ratios: list[dict]) -> str:
    rows = ["| round | order | policy | baseline mean / p50 E2E s | policy mean / p50 E2E s | mean ratio | p50 ratio "
            "| steady TPOT ratio |", "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in ratios:
        (bm, pm), (bp, pp) = r["mean_e2el_s"], r["p50_e2el_s"]
        rows.append(f"| {r['round']} | {', '.join(r['order'])} | {r['policy']} / {r['baseline']} | {bm:.2f} / {bp:.2f} "
                    f"| {pm:.2f} / {pp:.2f} | {r['mean_ratio']:.3f} | {r['p50_ratio']:.3f} | "
                    f"{r['steady_tpot_ratio']:.3f} |")
    for policy in dict.fromkeys(r["policy"] for r in ratios):
        mine = [r for r in ratios if r["policy"] == policy]
        med = {k: statistics.median(r[k] for r in mine) for k in ("mean_ratio", "p50_ratio", "steady_tpot_ratio")}
        rows.append(f"| median of {len(mine)} | | {policy} / {mine[0]['baseline']} | | | **{med['mean_ratio']:.3f}** | "
                    f"**{med['p50_ratio']:.3f}** | {med['steady_tpot_ratio']:.3f} |")
    return "\n".join(rows)


def write_outputs(args: argparse.Namespace, rate: float, rounds: list[dict[str, BenchmarkRun]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    pooled = {p: [r for runs in rounds for r in runs[p].records] for p in args.policies}
    failed = sum(not r.success for records in pooled.values() for r in records)
    header = (f"{args.model}, {args.dtype}: {len(rounds)} rounds of {args.num_prompts} prompts of {args.input_len} "
              f"tokens, outputs {args.output_lens} ({args.long_fraction:.0%} long), Poisson at {rate_label(rate)} "
              f"req/s; {'colocated' if args.colocated else '1 prefill + 1 decode'}, decode args "
              f"{args.decode_args!r}; sjf factor {args.sjf_length_factor:g}, aging {args.sjf_aging_s:g} s"
              + (f"; {failed} requests failed" if failed else ""))
    ratios = round_ratios(rounds, args.policies)
    throughput = "\n".join(
        f"- round {i + 1}, {p}: {s['request_throughput']:.3f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"duration {s['duration_s']:.1f} s"
        for i, runs in enumerate(rounds) for p, run in runs.items()
        for s in [summarize(run.records, run.duration_s, PERCENTILES)])
    text = (f"{header}\n\nE2E latency, all rounds pooled:\n\n{by_length_table(pooled)}\n\n"
            f"Per round (order alternates; the steady TPOT ratio is the drift check):\n\n{ratio_table(ratios)}\n\n"
            f"Queue wait apart from decode time, all rounds pooled:\n\n{wait_table(pooled)}\n\n{throughput}\n")
    (args.out / "sjf.md").write_text(text)
    print(f"\n{text}")
    doc = {"config": {**vars(args), "request_rate": rate}, "ratios": ratios,
           "pooled": {p: e2e_by_output_len(records) for p, records in pooled.items()},
           "rounds": [{p: {**run_to_dict(run, summarize(run.records, run.duration_s, PERCENTILES)),
                           "e2e_by_output_len": e2e_by_output_len(run.records)} for p, run in runs.items()}
                      for runs in rounds]}
    write_json(args.out / "sjf.json", doc, indent=1)
    print(f"wrote {args.out}/sjf.md, sjf.json")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rate = None if args.request_rate == "auto" else args.request_rate
    rounds: list[dict[str, BenchmarkRun]] = []
    with contextlib.ExitStack() as stacks:
        # every stack up for the whole run: an idle one costs nothing but its heartbeats
        stack = {p: stacks.enter_context(PolicyStack(args, p)) for p in args.policies}
        if args.num_warmups:  # requests of their own (seed -2), so no prompt of a timed round is cached
            warm = workload(args, seed=args.seed - 2)[:args.num_warmups]
            for s in stack.values():
                s.run(warm, math.inf, args.seed)
        if rate is None:
            rate = calibrate(stack[args.policies[0]], args)
        for i in range(args.rounds):
            samples = workload(args, seed=args.seed + i)
            order = args.policies if i % 2 == 0 else args.policies[::-1]
            runs = {}
            for p in order:
                print(f"round {i + 1}/{args.rounds}: {p}", flush=True)
                runs[p] = stack[p].run(samples, rate, args.seed + i)
            rounds.append(runs)
    write_outputs(args, rate, rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
