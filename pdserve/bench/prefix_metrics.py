"""The prefix-cache figures of the `conversation` and `system-prompt` workloads, added to the summary.

Over the successful requests:

- `prefix_hit_rate`: the prompt tokens the server served from its prefix cache (usage's
  `prompt_tokens_details.cached_tokens`) over the prompt tokens, counting the requests whose usage
  reports it (`num_cached_reported` of them). None (printed n/a) when no response reports it: a
  missing field is unknown, not 0.
- `recomputed_tokens_per_request`: the mean of prompt tokens - cached tokens over those requests.
- `oracle_hit_rate`: the same ratio for the prefix oracle (`prefix_oracle.py`) replaying the exact
  token ids of the run in the order sent, with `oracle_cache_blocks` blocks of `oracle_block_size`
  tokens (the fleet's pools from `GET /nodes`, or `--oracle-cache-blocks`; None: an unbounded cache).
  None when a prompt was text (its token ids are not known).
- `kv_bytes_received` and `kv_bytes_per_request`: the decode nodes' received-KV counters' increase
  over the run (`fleet_probe.py`) and that over the successful requests. None when the server is not
  a pdserve router. The counters are fleet-wide: the split per turn cannot be read from them.
- Conversations also get `prefix_hit_rate_followup` and `oracle_hit_rate_followup` (turns after the
  first, where the history can hit), `num_first_turns`, `num_followup_turns` and TTFT statistics
  split into first turns (`*_ttft_first_turn_ms`: mean, median, std, the percentiles) and follow-up
  turns (`*_ttft_followup_ms`).
"""

from __future__ import annotations

import sys
from typing import TextIO

from pdserve.bench.fleet_probe import FleetSnapshot, kv_bytes_received
from pdserve.bench.metrics import percentile_key, stats_ms
from pdserve.bench.prefix_oracle import DEFAULT_BLOCK_SIZE, oracle_hits
from pdserve.bench.request_record import RequestRecord

WIDTH = 50


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def _hit_rate(records: list[RequestRecord]) -> float | None:
    known = [r for r in records if r.cached_tokens is not None]
    return _ratio(sum(r.cached_tokens for r in known), sum(r.prompt_len for r in known)) if known else None


def prefix_summary(records: list[RequestRecord], percentiles: list[float], *, conversation: bool = False,
                   fleet: tuple[FleetSnapshot | None, FleetSnapshot | None] | None = None,
                   oracle_cache_blocks: int | None = None,
                   oracle_block_size: int = DEFAULT_BLOCK_SIZE) -> dict:
    """The keys the module docstring lists. `fleet`: (before, after) snapshots of the run."""
    ok = [r for r in records if r.success]
    known = [r for r in ok if r.cached_tokens is not None]
    out: dict = {"prefix_hit_rate": _hit_rate(ok), "num_cached_reported": len(known),
                 "recomputed_tokens_per_request": (sum(r.prompt_len - r.cached_tokens for r in known) / len(known)
                                                   if known else None),
                 "oracle_hit_rate": None, "oracle_cache_blocks": oracle_cache_blocks,
                 "oracle_block_size": oracle_block_size}
    oracle: dict[int, int] = {}  # id(record) → oracle hit tokens
    if ok and all(r.prompt_ids is not None for r in ok):
        order = sorted(ok, key=lambda r: r.start_s)
        hits = oracle_hits(((r.prompt_ids, r.output_ids) for r in order), oracle_block_size, oracle_cache_blocks)
        oracle = {id(r): h for r, h in zip(order, hits)}
        out["oracle_hit_rate"] = _ratio(sum(hits), sum(len(r.prompt_ids) for r in order))
    kv = kv_bytes_received(*fleet) if fleet is not None else None
    out["kv_bytes_received"] = kv
    out["kv_bytes_per_request"] = kv / len(ok) if kv is not None and ok else None
    if conversation:
        first = [r for r in ok if r.turn == 0]
        later = [r for r in ok if r.turn is not None and r.turn > 0]
        out["num_first_turns"], out["num_followup_turns"] = len(first), len(later)
        out["prefix_hit_rate_followup"] = _hit_rate(later)
        out["oracle_hit_rate_followup"] = (_ratio(sum(oracle[id(r)] for r in later),
                                                  sum(len(r.prompt_ids) for r in later)) if oracle else None)
        out.update(stats_ms([r.ttft_s for r in first], percentiles, "ttft_first_turn"))
        out.update(stats_ms([r.ttft_s for r in later], percentiles, "ttft_followup"))
    return out


def _fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def print_prefix_summary(summary: dict, out: TextIO | None = None) -> None:
    """The prefix-cache section under vLLM's table."""
    out = out or sys.stdout
    blocks = summary.get("oracle_cache_blocks")
    cache = "unbounded" if blocks is None else f"{blocks} blocks"
    rows = [("Prefix hit rate (cached/prompt):", _fmt(summary["prefix_hit_rate"], ".3f")),
            (f"Oracle hit rate ({cache}):", _fmt(summary["oracle_hit_rate"], ".3f")),
            ("Recomputed tokens per request:", _fmt(summary["recomputed_tokens_per_request"], ".1f")),
            ("KV bytes received per request:", _fmt(summary["kv_bytes_per_request"], ".0f"))]
    if "num_followup_turns" in summary:
        rows += [("Prefix hit rate, follow-up turns:", _fmt(summary["prefix_hit_rate_followup"], ".3f")),
                 ("Oracle hit rate, follow-up turns:", _fmt(summary["oracle_hit_rate_followup"], ".3f"))]
        ps = [p for p in (50.0, 99.0) if f"{percentile_key(p)}_ttft_first_turn_ms" in summary]
        label = " / ".join(percentile_key(p).upper() for p in ps)
        for kind, name in (("first_turn", f"first turns ({summary['num_first_turns']})"),
                           ("followup", f"follow-ups ({summary['num_followup_turns']})")):
            values = " / ".join(f"{summary[f'{percentile_key(p)}_ttft_{kind}_ms']:.2f}" for p in ps)
            rows.append((f"TTFT {label} (ms), {name}:", values))
    print(f"{' Prefix cache ':-^{WIDTH}}", file=out)
    for label, value in rows:
        print(f"{label:<40} {value}", file=out)
