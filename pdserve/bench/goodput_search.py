"""Goodput search, as DistServe defines goodput: the highest request rate at which at least a
target share (`attainment`, e.g. 0.9) of requests meets every latency SLO (TTFT and TPOT).

`search_goodput` is pure: `probe(rate)` runs (or simulates) a benchmark at `rate` and returns the
share of requests that met the SLOs. The search assumes attainment falls as the rate rises:

1. probe `lo`; if it fails, goodput is 0 (the server misses the target even at the lowest rate);
2. bracket: double the rate (capped at `hi`) until a probe fails; if `hi` itself passes, `hi` is
   reported as a lower bound (the true goodput may be higher);
3. bisect between the highest passing and lowest failing rate, `iters` times.

The answer is the highest rate that passed; `upper` the lowest that failed (the goodput lies in
[goodput, upper)). A noisy, non-monotone curve can make the bisection settle on a local edge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

FOUND, BELOW_MIN, AT_MAX = "found", "below_min", "at_max"


@dataclass(frozen=True)
class Probe:
    rate: float  # req/s
    attainment: float  # share of requests meeting every SLO, in [0, 1]
    passed: bool  # attainment >= target


@dataclass
class SearchResult:
    goodput: float  # the highest passing rate (req/s); 0 when even `lo` failed
    status: str  # FOUND, BELOW_MIN (even lo failed) or AT_MAX (hi passed: goodput is a lower bound)
    upper: float | None  # the lowest failing rate; None when none failed
    target: float
    probes: list[Probe] = field(default_factory=list)  # in the order run

    @property
    def message(self) -> str:
        pct = f"{self.target:.0%}"
        if self.status == BELOW_MIN:
            return (f"goodput 0 req/s: even the lowest rate probed ({self.upper:g} req/s) has fewer than {pct} of "
                    f"requests meeting the SLOs (lower --search-min-rate, or relax the SLOs)")
        if self.status == AT_MAX:
            return (f"goodput >= {self.goodput:g} req/s: the highest rate probed still meets the SLOs for {pct} "
                    f"of requests, so this is a lower bound (raise --search-max-rate)")
        return (f"goodput {self.goodput:g} req/s: {pct} of requests meet the SLOs up to this rate "
                f"(fails at {self.upper:g} req/s)")


def search_goodput(probe: Callable[[float], float], lo: float, hi: float, iters: int,
                   target: float) -> SearchResult:
    if not (0 < lo <= hi and math.isfinite(hi)):
        raise ValueError(f"goodput search needs 0 < min rate <= max rate < inf, got {lo:g} and {hi:g}")
    if iters < 0:
        raise ValueError(f"goodput search iterations must be >= 0, got {iters}")
    if not 0 < target <= 1:
        raise ValueError(f"goodput attainment target must be in (0, 1], got {target:g}")
    result = SearchResult(goodput=0.0, status=FOUND, upper=None, target=target)

    def passes(rate: float) -> bool:
        attainment = float(probe(rate))
        if not 0 <= attainment <= 1:
            raise ValueError(f"probe at {rate:g} req/s returned attainment {attainment}, not in [0, 1]")
        ok = attainment >= target
        result.probes.append(Probe(rate, attainment, ok))
        return ok

    if not passes(lo):
        result.status, result.upper = BELOW_MIN, lo
        return result
    good, bad = lo, None
    while good < hi:  # bracket
        rate = min(good * 2, hi)
        if not passes(rate):
            bad = rate
            break
        good = rate
    if bad is None:
        result.goodput, result.status = good, AT_MAX
        return result
    for _ in range(iters):  # bisect
        mid = (good + bad) / 2
        if passes(mid):
            good = mid
        else:
            bad = mid
    result.goodput, result.upper = good, bad
    return result


def probe_table(result: SearchResult, extra: dict[float, dict] | None = None) -> str:
    """A markdown table of the probes in rate order; `extra[rate]` adds the run's summary figures
    (request throughput, TTFT/TPOT p90) when given."""
    rows = ["| rate (req/s) | attainment | meets target | req/s | TTFT p90 ms | TPOT p90 ms |",
            "| --- | --- | --- | --- | --- | --- |"]
    for p in sorted(result.probes, key=lambda p: p.rate):
        s = (extra or {}).get(p.rate, {})
        rows.append(f"| {p.rate:g} | {p.attainment:.1%} | {'yes' if p.passed else 'no'} | "
                    f"{_fmt(s, 'request_throughput', '.2f')} | {_fmt(s, 'p90_ttft_ms', '.1f')} | "
                    f"{_fmt(s, 'p90_tpot_ms', '.1f')} |")
    return "\n".join(rows)


def _fmt(summary: dict, key: str, spec: str) -> str:
    return "-" if summary.get(key) is None else format(summary[key], spec)


def result_to_dict(result: SearchResult) -> dict:
    return {"goodput": result.goodput, "status": result.status, "upper": result.upper, "target": result.target,
            "message": result.message, "probes": [vars(p) for p in result.probes]}
