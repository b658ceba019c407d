"""Request traces: replay of the public Azure LLM-inference trace format, and a synthetic workload
whose request mix shifts between phases (the case a static prefill/decode split handles worst).

Azure format (github.com/Azure/AzurePublicDataset, AzureLLMInferenceTrace_*.csv): a CSV with the header
`TIMESTAMP,ContextTokens,GeneratedTokens`, one row per request. TIMESTAMP is a datetime string with
up to 7 fractional digits (`2023-11-16 18:15:46.6805900`, 100 ns resolution); plain float seconds are
accepted too (one form per file). Extra columns are ignored.

`benchmarks/traces/azure_synthetic.csv` is a small SYNTHETIC trace in that format, not Azure's
data; it is written by the deterministic command

    python -m pdserve.bench.traces --write-synthetic benchmarks/traces/azure_synthetic.csv

(`synthetic_trace()` below: the shifting workload at 2 req/s for 180 s, phases every 30 s).

These functions are also imported by the fleet simulator (benchmarks/fleet_sim.py): keep their
signatures.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import length_range

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
DEFAULT_PHASES = (("chat", 1000, 200), ("summarize", 4000, 100), ("generate", 200, 1000))
# The first timestamp written by write_azure_trace (the 2023 Azure trace's first day; any fixed date would do).
TRACE_EPOCH = datetime(2023, 11, 16, 18, 0, 0)
_TICKS_PER_S = 10_000_000  # Azure timestamps have 7 fractional digits: 100 ns ticks


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float  # seconds after the trace's first request
    input_len: int  # prompt tokens
    output_len: int  # tokens to generate
    phase: str = ""  # the shifting workload's phase name; "" for a loaded trace


def parse_timestamp(text: str) -> float | datetime:
    """A float (seconds) or a datetime: `2023-11-16 18:15:46.6805900` (fraction of any length up to
    100 ns, which `datetime.strptime` cannot take; kept to the microsecond), or anything
    `datetime.fromisoformat` accepts."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        if not math.isfinite(value):
            raise ValueError(f"timestamp {text!r} is not finite")
        return value
    whole, dot, frac = text.partition(".")
    if dot and frac.isdigit():
        try:
            base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
        except ValueError:
            pass
        else:
            return base + timedelta(microseconds=int(frac.ljust(7, "0")[:7]) / 10)
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"timestamp {text!r} is neither seconds nor a date like 2023-11-16 18:15:46.6805900") from None


def _token_count(text: str, column: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise ValueError(f"{column} {text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{column} {value} is negative")
    return value


def load_azure_trace(path, *, max_requests=None, time_scale=1.0) -> list[TraceRequest]:
    """The trace's requests sorted by arrival, arrivals relative to the earliest and multiplied by
    `time_scale` (0.5 replays twice as fast); the first `max_requests` of them when given. Token
    counts are taken as they are (0 allowed; the benchmark client asks for at least one of each)."""
    path = Path(path)
    if not time_scale > 0 or not math.isfinite(time_scale):
        raise ValueError(f"trace time scale must be a finite number > 0, got {time_scale}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    if not path.is_file():
        raise ValueError(f"trace file {path} does not exist")
    rows: list[tuple[float | datetime, int, int]] = []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: line 1: the header must name {','.join(AZURE_COLUMNS)} "
                             f"(Azure LLM inference trace format), got {','.join(header) or 'an empty line'!r}")
        cols = [header.index(c) for c in AZURE_COLUMNS]
        for row in reader:
            line = reader.line_num
            if not any(cell.strip() for cell in row):
                continue  # blank line
            try:
                if len(row) < len(header):
                    raise ValueError(f"{len(row)} fields, the header has {len(header)}")
                stamp = parse_timestamp(row[cols[0]])
                if rows and type(stamp) is not type(rows[0][0]):
                    raise ValueError("mixes float-seconds and datetime timestamps")
                if isinstance(stamp, datetime) and rows and (stamp.tzinfo is None) != (rows[0][0].tzinfo is None):
                    raise ValueError("mixes timestamps with and without a time zone")
                rows.append((stamp, _token_count(row[cols[1]], AZURE_COLUMNS[1]),
                             _token_count(row[cols[2]], AZURE_COLUMNS[2])))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}: line {line}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: the trace has a header but no requests")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    out = []
    for stamp, n_in, n_out in rows[:max_requests]:
        delta = (stamp - t0).total_seconds() if isinstance(stamp, datetime) else stamp - t0
        out.append(TraceRequest(delta * time_scale, n_in, n_out))
    return out


def write_azure_trace(path, requests) -> None:
    """Write `requests` in the Azure format, TIMESTAMP as datetimes from TRACE_EPOCH with 7 fractional
    digits as Azure's (loading keeps microseconds, Python's datetime resolution, so arrivals
    round-trip within 1e-6 s). The phase is not part of the format and is lost."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(AZURE_COLUMNS)
        for r in requests:
            ticks = round(r.arrival_s * _TICKS_PER_S)
            if ticks < 0:
                raise ValueError(f"arrival {r.arrival_s} is negative")
            secs, frac = divmod(ticks, _TICKS_PER_S)
            stamp = TRACE_EPOCH + timedelta(seconds=secs)
            writer.writerow([f"{stamp:%Y-%m-%d %H:%M:%S}.{frac:07d}", r.input_len, r.output_len])


def shifting_trace(*, phases=DEFAULT_PHASES, period_s, rate, duration_s, burstiness=1.0, seed=0,
                   range_ratio=0.0, scale=1.0) -> list[TraceRequest]:
    """Arrivals over [0, duration_s) at `rate` req/s (gamma gaps of shape `burstiness`, as
    arrivals.py), whose request mix changes every `period_s` seconds, cycling through `phases`
    ((name, input_len, output_len), ...): a request arriving at t belongs to phase
    `phases[int(t // period_s) % len(phases)]`. Lengths are the phase's times `scale` (at least 1),
    then drawn uniformly in len*[1-r, 1+r] as the random dataset does (r = `range_ratio`). Seeded."""
    phases = tuple(tuple(p) for p in phases)
    if not phases:
        raise ValueError("shifting workload needs at least one phase")
    for p in phases:
        if len(p) != 3 or not isinstance(p[0], str) or any(not isinstance(n, int) or n < 1 for n in p[1:]):
            raise ValueError(f"a phase is (name, input_len >= 1, output_len >= 1), got {p!r}")
    for name, value in (("period_s", period_s), ("rate", rate), ("duration_s", duration_s), ("scale", scale)):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"shifting workload {name} must be a finite number > 0, got {value}")
    n = max(16, math.ceil(rate * duration_s * 1.2) + 10)
    while True:  # enough arrivals to pass duration_s (the same seed: a longer draw extends the shorter)
        offsets = arrival_offsets(n, rate, burstiness, seed)
        if offsets[-1] >= duration_s:
            break
        n *= 2
    rng = random.Random(seed)
    ranges = {name: (length_range(max(1, round(i * scale)), range_ratio),
                     length_range(max(1, round(o * scale)), range_ratio)) for name, i, o in phases}
    out = []
    for t in offsets:
        if t >= duration_s:
            break
        name = phases[int(t // period_s) % len(phases)][0]
        (in_lo, in_hi), (out_lo, out_hi) = ranges[name]
        out.append(TraceRequest(t, rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi), name))
    return out


def synthetic_trace() -> list[TraceRequest]:
    """The shipped benchmarks/traces/azure_synthetic.csv: SYNTHETIC (not Azure's data)."""
    return shifting_trace(period_s=30.0, rate=2.0, duration_s=180.0, burstiness=1.0, seed=0, range_ratio=0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.traces", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-synthetic", type=Path, required=True, metavar="FILE.csv",
                        help="write the synthetic trace (deterministic) in the Azure format")
    args = parser.parse_args(argv)
    requests = synthetic_trace()
    write_azure_trace(args.write_synthetic, requests)
    print(f"wrote {len(requests)} requests to {args.write_synthetic}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
