"""Records → the benchmark summary, with vLLM's metric names and definitions.

Only successful requests count toward tokens and latencies. Throughputs divide by the wall time of
the timed run. TPOT is (E2E - TTFT) / (output tokens - 1) per request, over requests with more than
one output token; ITL is every inter-token gap of every request, pooled (a chunk of k tokens
counts as k gaps of a k-th of its delay: client.py). Percentiles are numpy's (linear
interpolation). Goodput is the number of successful requests that meet every SLO
given (a single-token request has TPOT 0, so it meets any TPOT SLO), per second of the run.
"""

from __future__ import annotations

import numpy as np

from pdserve.bench.request_record import RequestRecord

# metric key → the section title vLLM prints
METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
SLO_NAMES = {"ttft": "ttft", "tpot": "tpot", "e2el": "e2el", "e2e": "e2el"}  # accepted spelling → metric


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] → {'ttft': 500.0, 'tpot': 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name.strip().lower() not in SLO_NAMES:
            raise ValueError(f"an SLO is NAME:MILLISECONDS with NAME in ttft, tpot, e2e; got {item!r}")
        ms = float(value)
        if not ms > 0:
            raise ValueError(f"an SLO must be > 0 ms, got {item!r}")
        slos[SLO_NAMES[name.strip().lower()]] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"percentiles must be numbers in [0, 100], got {text!r}")
    return values


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def stats_ms(values_s: list[float], percentiles: list[float], name: str) -> dict[str, float]:
    """mean/median/std/percentiles of `values_s`, in ms, under vLLM's keys (`p99_ttft_ms`). 0 when empty."""
    arr = np.asarray(values_s, dtype=float) * 1000.0
    empty = arr.size == 0
    out = {f"mean_{name}_ms": 0.0 if empty else float(arr.mean()),
           f"median_{name}_ms": 0.0 if empty else float(np.median(arr)),
           f"std_{name}_ms": 0.0 if empty else float(arr.std())}
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = 0.0 if empty else float(np.percentile(arr, p))
    return out


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": record.ttft_s * 1000, "tpot": record.tpot_s * 1000, "e2el": record.e2el_s * 1000}
    return record.success and all(values_ms[name] <= limit for name, limit in slos.items())


def metric_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric values in seconds over the successful records (ITL pooled)."""
    ok = [r for r in records if r.success]
    return {"ttft": [r.ttft_s for r in ok], "tpot": [r.tpot_s for r in ok if r.output_len > 1],
            "itl": [gap for r in ok for gap in r.itl_s], "e2el": [r.e2el_s for r in ok]}


def error_counts(records: list[RequestRecord], limit: int = 5) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        if not r.success:
            counts[r.error] = counts.get(r.error, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:limit])


def summarize(records: list[RequestRecord], duration_s: float, percentiles: list[float],
              slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in records if r.success]
    duration = max(duration_s, 1e-9)
    num_input, num_output = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    summary = {"completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration_s,
               "total_input_tokens": num_input, "total_output_tokens": num_output,
               "request_throughput": len(ok) / duration, "output_throughput": num_output / duration,
               "total_token_throughput": (num_input + num_output) / duration,
               "slos_ms": dict(slos or {}), "num_good": None, "request_goodput": None,
               "percentiles": list(percentiles), "errors": error_counts(records)}
    if slos:
        summary["num_good"] = sum(meets_slos(r, slos) for r in ok)
        summary["request_goodput"] = summary["num_good"] / duration
    for name, values in metric_values(records).items():
        summary.update(stats_ms(values, percentiles, name))
    return summary
