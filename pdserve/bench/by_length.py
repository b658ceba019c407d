"""E2E latency split by the output length asked for (`max_tokens`): the short and the long requests
of the bimodal workload, each with its own mean and percentiles (shortest-job-first helps the one
and costs the other, and a pooled figure hides both)."""

from __future__ import annotations

from pdserve.bench.metrics import stats_ms
from pdserve.bench.request_record import RequestRecord

PERCENTILES = [50.0, 99.0]


def e2e_stats(records: list[RequestRecord]) -> dict:
    """count, mean, median, std and p50/p99 E2E (ms) over the successful records."""
    values = [r.e2el_s for r in records if r.success]
    return {"count": len(values), **stats_ms(values, PERCENTILES, "e2el")}


def e2e_by_output_len(records: list[RequestRecord]) -> dict[str, dict]:
    """{"all": stats, "max_tokens=16": stats, "max_tokens=512": stats, ...}, shortest class first."""
    out = {"all": e2e_stats(records)}
    for max_tokens in sorted({r.max_tokens for r in records}):
        out[f"max_tokens={max_tokens}"] = e2e_stats([r for r in records if r.max_tokens == max_tokens])
    return out


def by_length_table(results: dict[str, list[RequestRecord]]) -> str:
    """A markdown table, one row per (label, class): label is e.g. the scheduling policy."""
    rows = ["| run | requests | n | mean E2E ms | p50 E2E ms | p99 E2E ms |", "| --- | --- | --- | --- | --- | --- |"]
    for label, records in results.items():
        for group, s in e2e_by_output_len(records).items():
            rows.append(f"| {label} | {group} | {s['count']} | {s['mean_e2el_ms']:.0f} | {s['p50_e2el_ms']:.0f} | "
                        f"{s['p99_e2el_ms']:.0f} |")
    return "\n".join(rows)
