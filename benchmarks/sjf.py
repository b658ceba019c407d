"""First come, first served against shortest job first, one bimodal workload, one run.

The same requests (random token-id prompts of `--input-len`; each asks for the short or, with
probability `--long-fraction`, the long output of `--output-lens`, exactly, with ignore_eos) and
the same Poisson arrival times go to one `pdserve serve` stack per policy (`--policies`), load-tested
over HTTP by `pdserve bench serve`'s client. The table gives mean / p50 / p99 E2E latency over all
requests, then the short and the long ones apart.

Shortest job first only reorders a queue, so the stack needs one: the batch must fill up. The
decode node's `--max-num-seqs` (`--decode-args`, default 8 here) caps it; the arrival rate must be
near what the stack can serve. `--request-rate auto` (the default) measures that first: a burst
of `--calibration-prompts` requests at once on the first policy's stack gives its request
throughput, and the run goes at `--load` (0.9) times it.

    python -m benchmarks.sjf --model smollm2 --num-prompts 300 --input-len 128 --output-lens 16,512 \\
        --long-fraction 0.2 --decode-args "--max-num-seqs 8" --sjf-aging-s 30 --out results/sjf

Writes OUT/sjf.md (the table, also printed) and OUT/sjf.json (every summary and request).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from pathlib import Path

from pdserve.bench.arrivals import parse_rate
from pdserve.bench.by_length import by_length_table, e2e_by_output_len
from pdserve.bench.client import EndpointConfig
from pdserve.bench.datasets import SampleRequest, bimodal_requests, parse_output_lens
from pdserve.bench.json_out import write_json
from pdserve.bench.metrics import summarize
from pdserve.bench.report import rate_label, run_to_dict
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--policies", type=policy_list, default="fcfs,sjf",
                   help="comma-separated scheduling policies, in run order")
    p.add_argument("--num-prompts", type=int, default=300)
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
        from pdserve.bench.cli import first_model_id
        from pdserve.bench.stack import Stack

        extra = ["--dtype", args.dtype, "--scheduling-policy", policy, "--sjf-length-factor",
                 str(args.sjf_length_factor), "--sjf-aging-s", str(args.sjf_aging_s), *args.serve_args.split()]
        node_args = args.prefill_args
        if args.colocated:  # the node prefills and decodes: it takes the decode node's cap too
            node_args = f"{args.prefill_args} {args.decode_args}"
        print(f"starting {policy}: pdserve serve {' '.join(extra)}", flush=True)
        self.stack = Stack(args.model, extra=extra, colocated=args.colocated, prefill_args=node_args,
                           decode_args=args.decode_args, timeout=args.ready_timeout)
        self.cfg = EndpointConfig(self.stack.url + "/v1/completions", first_model_id(self.stack.url), ignore_eos=True)

    def run(self, samples: list[SampleRequest], rate: float, seed: int, num_warmups: int = 0) -> BenchmarkRun:
        load = LoadConfig(rate, seed=seed, num_warmups=num_warmups)
        return asyncio.run(run_benchmark(self.cfg, samples, load, BenchmarkRun()))

    def __enter__(self) -> PolicyStack:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()


def calibrate(stack: PolicyStack, samples: list[SampleRequest], args: argparse.Namespace) -> float:
    burst = samples[:args.calibration_prompts]
    run = stack.run(burst, math.inf, args.seed)
    throughput = summarize(run.records, run.duration_s, PERCENTILES)["request_throughput"]
    rate = args.load * throughput
    print(f"calibration: {len(burst)} requests at once -> {throughput:.3f} req/s; running at {rate:.3f} req/s",
          flush=True)
    return rate


def workload(args: argparse.Namespace) -> list[SampleRequest]:
    from pdserve.bench.datasets import load_tokenizer
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(resolve_model(args.model)).vocab_size
    tokenizer = load_tokenizer(args.model)
    if tokenizer is not None:  # the router refuses ids its tokenizer does not know
        vocab = min(vocab, len(tokenizer))
    return bimodal_requests(args.num_prompts, args.input_len, parse_output_lens(args.output_lens), args.long_fraction,
                            vocab_size=vocab, seed=args.seed)


def write_outputs(args: argparse.Namespace, rate: float, runs: dict[str, BenchmarkRun]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    summaries = {p: summarize(run.records, run.duration_s, PERCENTILES) for p, run in runs.items()}
    failed = ", ".join(f"{p}: {s['failed']} failed" for p, s in summaries.items() if s["failed"])
    header = (f"{args.model}, {args.dtype}: {args.num_prompts} prompts of {args.input_len} tokens, outputs "
              f"{args.output_lens} ({args.long_fraction:.0%} long), Poisson at {rate_label(rate)} req/s; "
              f"{'colocated' if args.colocated else '1 prefill + 1 decode'}, decode args {args.decode_args!r}; "
              f"sjf factor {args.sjf_length_factor:g}, aging {args.sjf_aging_s:g} s" + (f"; {failed}" if failed else ""))
    throughput = "\n".join(f"- {p}: {s['request_throughput']:.3f} req/s, {s['output_throughput']:.1f} output tok/s, "
                           f"duration {s['duration_s']:.1f} s" for p, s in summaries.items())
    table = by_length_table({p: run.records for p, run in runs.items()})
    (args.out / "sjf.md").write_text(f"{header}\n\n{table}\n\n{throughput}\n")
    print(f"\n{header}\n\n{table}\n\n{throughput}\n")
    doc = {"config": {**vars(args), "request_rate": rate},
           "policies": {p: {**run_to_dict(run, summaries[p]), "e2e_by_output_len": e2e_by_output_len(run.records)}
                        for p, run in runs.items()}}
    write_json(args.out / "sjf.json", doc, indent=1)
    print(f"wrote {args.out}/sjf.md, sjf.json")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    samples = workload(args)
    rate = None if args.request_rate == "auto" else args.request_rate
    runs: dict[str, BenchmarkRun] = {}
    for policy in args.policies:
        with PolicyStack(args, policy) as stack:
            if rate is None:
                rate = calibrate(stack, samples, args)
            runs[policy] = stack.run(samples, rate, args.seed, num_warmups=args.num_warmups)
    write_outputs(args, rate, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
