"""The summary as vLLM prints it, the sweep table, and the JSON file.

JSON schema (`SCHEMA`): {"schema", "config": {flag: value}, "runs": [{"request_rate": float | "inf",
"interrupted": bool, "summary": {metrics.summarize keys}, "requests": [RequestRecord.to_dict()]}]}.
One run per request rate (one without --sweep). Rates are written "inf" rather than Infinity, which
is not JSON.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TextIO

from pdserve.bench.json_out import write_json
from pdserve.bench.metrics import METRICS, percentile_key
from pdserve.bench.runner import BenchmarkRun

SCHEMA = "pdserve-bench-serve/1"
WIDTH = 50
_SHORT = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _line(out: TextIO, label: str, value) -> None:
    text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
    print(f"{label:<40} {text}", file=out)


def print_summary(summary: dict, *, title: str = " Serving Benchmark Result ", interrupted: bool = False,
                  percentiles: list[float] | None = None, out: TextIO | None = None) -> None:
    """vLLM's table; `percentiles` picks which of the computed ones to show (default: all; P50 is the
    median line)."""
    out = out or sys.stdout  # looked up per call, so redirected stdout is honoured
    print(f"{title:=^{WIDTH}}", file=out)
    if interrupted:
        print("(interrupted: partial results)", file=out)
    _line(out, "Successful requests:", summary["completed"])
    _line(out, "Failed requests:", summary["failed"])
    _line(out, "Benchmark duration (s):", summary["duration_s"])
    _line(out, "Total input tokens:", summary["total_input_tokens"])
    _line(out, "Total generated tokens:", summary["total_output_tokens"])
    _line(out, "Request throughput (req/s):", summary["request_throughput"])
    if summary.get("request_goodput") is not None:
        slos = " ".join(f"{k}:{v:g}" for k, v in summary["slos_ms"].items())
        _line(out, f"Request goodput (req/s) [{slos}]:", summary["request_goodput"])
    _line(out, "Output token throughput (tok/s):", summary["output_throughput"])
    _line(out, "Total Token throughput (tok/s):", summary["total_token_throughput"])
    for name, section in METRICS.items():
        print(f"{section:-^{WIDTH}}", file=out)
        short = _SHORT[name]
        _line(out, f"Mean {short} (ms):", summary[f"mean_{name}_ms"])
        _line(out, f"Median {short} (ms):", summary[f"median_{name}_ms"])
        for p in summary["percentiles"] if percentiles is None else percentiles:
            if p == 50:
                continue
            key = percentile_key(p)
            _line(out, f"{key.upper()} {short} (ms):", summary[f"{key}_{name}_ms"])
    for error, count in summary.get("errors", {}).items():
        print(f"error x{count}: {error}", file=out)
    print("=" * WIDTH, file=out)


def sweep_table(summaries: list[tuple[float, dict]]) -> str:
    """A markdown table: one row per request rate."""
    rows = ["| rate (req/s) | ok | failed | req/s | goodput | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for rate, s in summaries:
        goodput = "-" if s.get("request_goodput") is None else f"{s['request_goodput']:.2f}"
        rows.append(f"| {rate_label(rate)} | {s['completed']} | {s['failed']} | {s['request_throughput']:.2f} | "
                    f"{goodput} | {s['output_throughput']:.1f} | "
                    f"{s['median_ttft_ms']:.1f} / {s.get('p99_ttft_ms', float('nan')):.1f} | "
                    f"{s['median_tpot_ms']:.1f} / {s.get('p99_tpot_ms', float('nan')):.1f} |")
    return "\n".join(rows)


def run_to_dict(run: BenchmarkRun, summary: dict) -> dict:
    out = {"request_rate": rate_label(run.request_rate), "interrupted": run.interrupted, "summary": summary,
           "requests": [r.to_dict() for r in sorted(run.records, key=lambda r: r.request_id)]}
    if run.chaos is not None:
        out["chaos"] = {"events": [vars(e) for e in run.chaos.events],
                        "router_retries": run.chaos.retries_after - run.chaos.retries_before}
    return out


def save_json(path: str | Path, config: dict, runs: list[tuple[BenchmarkRun, dict]], *,
              extra: dict | None = None) -> Path:
    """`extra`: more top-level keys (`goodput_search` after --goodput-search)."""
    doc = {"schema": SCHEMA, "config": config, "runs": [run_to_dict(run, s) for run, s in runs], **(extra or {})}
    return write_json(path, doc, indent=1)
