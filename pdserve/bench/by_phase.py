"""Latency and SLO attainment per phase of the shifting workload (traces.shifting_trace): a pooled
figure averages a prefill-heavy phase with a decode-heavy one and hides that each stresses a
different pool."""

from __future__ import annotations

from pdserve.bench.metrics import meets_slos, stats_ms
from pdserve.bench.request_record import RequestRecord

PERCENTILES = [50.0, 90.0]


def phase_stats(records: list[RequestRecord], slos: dict[str, float] | None) -> dict:
    """requests, completed, TTFT/TPOT p50/p90 (ms) and, with SLOs, the share of requests (failed
    ones count as misses) meeting all of them."""
    ok = [r for r in records if r.success]
    out = {"requests": len(records), "completed": len(ok),
           **stats_ms([r.ttft_s for r in ok], PERCENTILES, "ttft"),
           **stats_ms([r.tpot_s for r in ok if r.output_len > 1], PERCENTILES, "tpot"),
           "slo_attainment": None}
    if slos and records:
        out["slo_attainment"] = sum(meets_slos(r, slos) for r in records) / len(records)
    return out


def by_phase(records: list[RequestRecord], phases: list[str], slos: dict[str, float] | None) -> dict[str, dict]:
    """{phase: phase_stats}, phases in order of first appearance; `phases[request_id]` names each
    record's phase."""
    groups: dict[str, list[RequestRecord]] = {name: [] for name in dict.fromkeys(phases)}
    for r in records:
        groups[phases[r.request_id]].append(r)
    return {name: phase_stats(group, slos) for name, group in groups.items()}


def phase_table(stats: dict[str, dict]) -> str:
    rows = ["| phase | requests | ok | TTFT p50 / p90 ms | TPOT p50 / p90 ms | SLO attainment |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, s in stats.items():
        att = "-" if s["slo_attainment"] is None else f"{s['slo_attainment']:.1%}"
        rows.append(f"| {name} | {s['requests']} | {s['completed']} | {s['p50_ttft_ms']:.1f} / {s['p90_ttft_ms']:.1f} | "
                    f"{s['p50_tpot_ms']:.1f} / {s['p90_tpot_ms']:.1f} | {att} |")
    return "\n".join(rows)
