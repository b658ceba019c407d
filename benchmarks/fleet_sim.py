"""A discrete-event fleet simulator (simpy) that runs the project's REAL router and planner code.

    python -m benchmarks.fleet_sim run          one run at --rate (or a goodput search: --goodput-search)
    python -m benchmarks.fleet_sim static-sweep goodput of P:D splits (planner off, policy always) + colocated
    python -m benchmarks.fleet_sim planner      planner (policy auto) vs best static split vs per-phase oracle
    python -m benchmarks.fleet_sim validate F   replay measured real-stack results with the fitted model
    python -m benchmarks.fleet_sim fit S.json   fit step samples with the router's StepModel -> --fit-file

What is real and what is simulated. The router is `pdserve.router.registry.Registry` with a
`pdserve.router.disagg.PathPolicy` (--policy always|never|auto), fed `Register` and `Heartbeat`
messages (every --heartbeat-s: free blocks, running, waiting, outstanding prompt tokens, ready,
request ids, role, the last <= 64 step samples); each request is routed with `Registry.route` and
accounted with `add_request`, `first_token`, `release_request` as router/request_table.py does,
and `WorkloadWindow.arrival/end` as router/dispatcher.py does. The planner is
`pdserve.router.planner_loop.PlannerLoop.tick` (hence `Planner.decide`) every --planner-interval,
its SetRole delivered to the simulated node. The nodes are simulated (fleet_sim_engine.py): each
runs engine steps of prefill chunks (--chunk tokens, shared by several prompts) plus one token per
running decode sequence, timed by the node model (fleet_sim_models.py: fitted coefficients or a
roofline, constants in its docstring). A prefill node emits the first token when the prompt is
in, then sends the KV (prompt tokens * KV bytes per token / --interconnect-gbps GB/s, one hand-off
at a time per node) to the decode node, which adds it to its batch when KV blocks and
--max-num-seqs allow. A decode node prefills a locally-routed request in chunks inside its decode
steps. A node asked to change role stops taking requests (its next heartbeat says not ready),
finishes what it holds, waits --switch-delay-s, and registers again (same node id and pid).

Metrics: per request TTFT and TPOT ((finish - first token) / (output - 1)); p50/p90; attainment =
share of requests meeting both --slo-ttft-ms and --slo-tpot-ms (unfinished ones miss); goodput =
the highest rate with attainment >= 90% (pdserve.bench.goodput_search bisection; a probe stops
early once more than 10% surely missed); per-phase attainment for the shifting trace.

validate input (JSON list; one object per measured run):
    [{"workload": {"input_len": 1000, "output_len": 200, "range_ratio": 0.0},
      "split": [1, 1],            # [prefill nodes, decode nodes]; [0, N] = colocated (policy never)
      "load": 2.0,                # request rate, req/s (Poisson), "duration_s" optional (default 60)
      "ttft_p50": 0.12, "ttft_p90": 0.2, "tpot_p50": 0.03, "tpot_p90": 0.035}]   # seconds
It prints, for each, the simulated value and the relative error (sim - measured) / measured.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import fleet_sim_models as models
from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.datasets import length_range
from pdserve.bench.goodput_search import search_goodput
from pdserve.bench.traces import DEFAULT_PHASES, TraceRequest, load_azure_trace, shifting_trace

try:
    import simpy  # noqa: F401
except ImportError:  # pragma: no cover - simpy is in the bench extra
    simpy = None

RESULTS = Path("benchmarks/results/fleet_sim")
ATTAINMENT = 0.9


# ---- workloads ---------------------------------------------------------------------------------
def poisson_trace(rate: float, duration_s: float, input_len: int, output_len: int, *, range_ratio: float = 0.0,
                  burstiness: float = 1.0, seed: int = 0, phase: str = "") -> list[TraceRequest]:
    import random

    n = max(1, math.ceil(rate * duration_s))
    offsets = arrival_offsets(n, rate, burstiness, seed)
    rng = random.Random(seed + 1)
    (ilo, ihi), (olo, ohi) = length_range(input_len, range_ratio), length_range(output_len, range_ratio)
    return [TraceRequest(t, rng.randint(ilo, ihi), rng.randint(olo, ohi), phase) for t in offsets if t < duration_s]


def parse_phases(text: str | None):
    if not text:
        return DEFAULT_PHASES
    out = []
    for part in text.split(","):
        bits = part.split(":")
        if len(bits) != 3:
            raise ValueError(f"--phases: each phase is name:input_len:output_len, got {part!r}")
        out.append((bits[0], int(bits[1]), int(bits[2])))
    return tuple(out)


def make_trace(args, rate: float) -> list[TraceRequest]:
    if args.workload == "poisson":
        return poisson_trace(rate, args.duration_s, args.input_len, args.output_len, range_ratio=args.range_ratio,
                             burstiness=args.burstiness, seed=args.seed)
    if args.workload == "shifting":
        return shifting_trace(phases=args.phases, period_s=args.period_s, rate=rate, duration_s=args.duration_s,
                              burstiness=args.burstiness, seed=args.seed, range_ratio=args.range_ratio)
    if args.workload == "azure":
        base = load_azure_trace(args.trace, max_requests=args.max_requests)
        span = max(1e-9, base[-1].arrival_s)
        native = len(base) / span
        return load_azure_trace(args.trace, max_requests=args.max_requests, time_scale=native / rate)
    raise ValueError(f"--workload must be poisson, shifting or azure, got {args.workload!r}")


# ---- one run ------------------------------------------------------------------------------------
def _pct(values, q):
    return float(np.percentile(values, q)) if len(values) else None


def summarize(fleet, trace_len: int, slo_ttft_s: float, slo_tpot_s: float, wall_s: float) -> dict:
    reqs = fleet.requests
    fin = [r for r in reqs if r.finish is not None]
    ttft = [r.ttft for r in fin]
    tpot = [r.tpot for r in fin if r.output_len > 1]
    ok = [r for r in fin if r.ttft <= slo_ttft_s and r.tpot <= slo_tpot_s]
    phases: dict[str, list[int]] = {}
    for r in reqs:
        if r.phase:
            p = phases.setdefault(r.phase, [0, 0])
            p[1] += 1
            p[0] += r.finish is not None and r.ttft <= slo_ttft_s and r.tpot <= slo_tpot_s
    nodes = fleet.nodes.values()
    return {
        "requests": trace_len, "finished": len(fin), "stopped_early": fleet.stopped_early,
        "attainment": len(ok) / trace_len if trace_len else 1.0,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p90_s": _pct(tpot, 90),
        "phase_attainment": {k: v[0] / v[1] for k, v in phases.items()},
        "local_prefills": sum(r.local for r in reqs), "retries": sum(r.retries for r in reqs),
        "role_changes": len(fleet.role_changes), "planner_ticks": len(fleet.decisions),
        "path_reasons": dict(fleet.path_reasons),
        "final_split": [sum(n.role == "prefill" for n in nodes), sum(n.role == "decode" for n in nodes)],
        "sim_time_s": fleet.env.now, "steps": sum(n.num_steps for n in nodes), "wall_s": wall_s,
    }


def simulate(model, trace, num_prefill: int, num_decode: int, cfg, *, keep=False):
    from benchmarks.fleet_sim_engine import Fleet

    t0 = time.perf_counter()
    fleet = Fleet(model, num_prefill, num_decode, cfg)
    fleet.run(trace)
    out = summarize(fleet, len(trace), cfg.slo_ttft_s, cfg.slo_tpot_s, time.perf_counter() - t0)
    return (out, fleet) if keep else out


def sim_config(args, *, policy=None, planner=None, early_stop=None):
    from benchmarks.fleet_sim_engine import SimConfig

    return SimConfig(chunk=args.chunk, max_num_seqs=args.max_num_seqs, heartbeat_s=args.heartbeat_s,
                     switch_delay_s=args.switch_delay_s, interconnect_Bps=args.interconnect_gbps * 1e9,
                     policy=policy or args.policy, planner=(args.planner == "on") if planner is None else planner,
                     planner_interval_s=args.planner_interval, planner_window_s=args.planner_window,
                     planner_cooldown_s=args.planner_cooldown, slo_ttft_s=args.slo_ttft_ms / 1e3,
                     slo_tpot_s=args.slo_tpot_ms / 1e3, drain_s=args.drain_s, early_stop=early_stop)


def goodput(args, model, split, *, policy, planner, trace_fn=None, log=None) -> dict:
    """Bisection over rate; `split` = (prefill, decode) at the start."""
    trace_fn = trace_fn or (lambda r: make_trace(args, r))
    runs = {}

    def probe(rate):
        cfg = sim_config(args, policy=policy, planner=planner, early_stop=1 - ATTAINMENT)
        res = simulate(model, trace_fn(rate), split[0], split[1], cfg)
        runs[rate] = res
        if log:
            log(f"    {split[0]}P+{split[1]}D {policy}{' planner' if planner else ''} rate {rate:.4g}: "
                f"attainment {res['attainment']:.3f}{' (stopped early)' if res['stopped_early'] else ''} "
                f"[{res['wall_s']:.1f} s]")
        return res["attainment"]

    t0 = time.perf_counter()
    sr = search_goodput(probe, args.search_min_rate, args.search_max_rate, args.search_iters, ATTAINMENT)
    best = runs.get(sr.goodput)
    return {"split": list(split), "policy": policy, "planner": planner, "goodput": sr.goodput, "status": sr.status,
            "upper": sr.upper, "probes": [[p.rate, p.attainment] for p in sr.probes], "at_goodput": best,
            "wall_s": time.perf_counter() - t0}


# ---- the node model ------------------------------------------------------------------------------
def node_model(args):
    if args.node_model == "roofline":
        return models.roofline(args.gpu, args.model_shape, args.tp)
    if args.node_model == "fitted":
        if not args.fit_file:
            raise ValueError("--node-model fitted needs --fit-file F.json (make one with the `fit` subcommand)")
        return models.fitted(args.fit_file, kv_bytes_per_token_=args.kv_bytes_per_token, num_blocks=args.num_blocks)
    raise ValueError(f"--node-model must be fitted or roofline, got {args.node_model!r}")


def num_nodes(args, model) -> int:
    if args.gpus is not None:
        if args.gpus % model.gpus_per_node:
            raise ValueError(f"--gpus {args.gpus} is not a multiple of the node's {model.gpus_per_node} GPUs (--tp)")
        n = args.gpus // model.gpus_per_node
    else:
        n = args.nodes
    if n < 1:
        raise ValueError(f"need at least 1 node, got {n}")
    return n


def sweep_splits(n: int, points: int) -> list[int]:
    """Prefill-node counts to try: about `points` of them, evenly over 1..n-1."""
    if n < 2:
        return []
    if points >= n - 1:
        return list(range(1, n))
    return sorted({max(1, min(n - 1, round(1 + i * (n - 2) / (points - 1)))) for i in range(points)})


def static_sweep(args, model, n, log, trace_fn=None) -> dict:
    rows = []
    splits = args.splits if args.splits else sweep_splits(n, args.sweep_points)
    if any(not 0 < p < n for p in splits):
        raise ValueError(f"--splits: prefill node counts must be in [1, {n - 1}], got {splits}")
    for p in splits:
        log(f"  split {p}P+{n - p}D")
        rows.append(goodput(args, model, (p, n - p), policy="always", planner=False, trace_fn=trace_fn, log=log))
    log(f"  colocated {n}D (policy never)")
    rows.append(goodput(args, model, (0, n), policy="never", planner=False, trace_fn=trace_fn, log=log))
    best = max(rows, key=lambda r: r["goodput"])
    return {"rows": rows, "best": {"split": best["split"], "policy": best["policy"], "goodput": best["goodput"]}}


# ---- experiments ------------------------------------------------------------------------------
def _fmt(x, scale=1e3, nd=0):
    return "-" if x is None else f"{x * scale:.{nd}f}"


def table(rows) -> str:
    out = ["| config | goodput (req/s) | TTFT p50/p90 (ms) | TPOT p50/p90 (ms) | search wall (s) |",
           "|---|---|---|---|---|"]
    for r in rows:
        a = r.get("at_goodput") or {}
        name = r.get("name") or (f"{r['split'][0]}P+{r['split'][1]}D {r['policy']}" + (" planner" if r.get("planner") else ""))
        out.append(f"| {name} | {r['goodput']:.3g}{'+' if r['status'] == 'at_max' else ''} | "
                   f"{_fmt(a.get('ttft_p50_s'))}/{_fmt(a.get('ttft_p90_s'))} | "
                   f"{_fmt(a.get('tpot_p50_s'), nd=1)}/{_fmt(a.get('tpot_p90_s'), nd=1)} | {r.get('wall_s', 0):.1f} |")
    return "\n".join(out)


def reconvergence(fleet, period_s: float, num_phases: int, slo_ttft_s, slo_tpot_s, window_s=10.0) -> list[dict]:
    """After each phase shift: when the planner's split last changed in that phase, and when the
    p90s over a sliding `window_s` of arrivals met both SLOs again (and stayed so for the phase)."""
    end = max((r.arrival for r in fleet.requests), default=0.0)
    shifts = [k * period_s for k in range(1, int(end // period_s) + 1)]
    out = []
    for s in shifts:
        e = s + period_s
        changes = [t for t, *_ in fleet.role_changes if s <= t < e]
        last_change = (max(changes) - s) if changes else 0.0
        met_at = None
        t = s
        while t + window_s <= min(e, end):
            win = [r for r in fleet.requests if t <= r.arrival < t + window_s and r.finish is not None]
            ok = bool(win) and np.percentile([r.ttft for r in win], 90) <= slo_ttft_s and \
                np.percentile([r.tpot for r in win], 90) <= slo_tpot_s
            if ok and met_at is None:
                met_at = t + window_s - s
            elif not ok:
                met_at = None
            t += window_s
        phase = fleet.requests[next((i for i, r in enumerate(fleet.requests) if r.arrival >= s), 0)].phase
        out.append({"shift_at_s": s, "phase": phase, "role_changes": len(changes),
                    "split_settled_after_s": last_change, "slos_met_after_s": met_at})
    return out


def run_planner(args, model, n, log) -> dict:
    res = {"nodes": n, "gpus": n * model.gpus_per_node, "model": model.describe(), "parts": args.parts}
    parts = set(args.parts)
    best = {"split": [0, n], "policy": "never", "goodput": 0.0}
    if "static" in parts:
        log("static splits on the shifting trace:")
        res["static"] = static_sweep(args, model, n, log)
        best = res["static"]["best"]
    if args.planner_start == "colocated":
        start = (0, n)
    elif args.planner_start == "best":
        start = tuple(best["split"])
    else:
        start = (int(args.planner_start), n - int(args.planner_start))
    res["planner_start"] = list(start)
    if "planner" in parts:
        log(f"planner on (policy auto), starting from {start[0]}P+{start[1]}D:")
        res["planner"] = goodput(args, model, start, policy="auto", planner=True, log=log)
    if "oracle" in parts:
        res.update(oracle_goodput(args, model, n, log))
    if "reconverge" in parts:
        # at the planner's goodput (or --rate when the planner part was not run)
        rate = (res.get("planner") or {}).get("goodput") or args.rate
        log(f"re-convergence run at {rate:.4g} req/s from {start[0]}P+{start[1]}D:")
        out, fleet = simulate(model, make_trace(args, rate), start[0], start[1],
                              sim_config(args, policy="auto", planner=True), keep=True)
        res["reconvergence_run"] = {"rate": rate, **out, "decisions": fleet.decisions,
                                    "role_changes": [list(c) for c in fleet.role_changes],
                                    "shifts": reconvergence(fleet, args.period_s, len(args.phases),
                                                            args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)}
    pg = (res.get("planner") or {}).get("goodput")
    og = (res.get("oracle") or {}).get("goodput")
    res["ratios"] = {"planner_over_best_static": pg / best["goodput"] if pg is not None and best["goodput"] else None,
                     "planner_over_oracle": pg / og if pg is not None and og else None}
    return res


def oracle_goodput(args, model, n, log) -> dict:
    """Each phase's workload alone through the static sweep; then the shifting trace's rate at which
    the phases, each on its own best static config, meet the SLOs for 90% of all requests."""
    res = {}
    oracle = {}
    for name, lin, lout in args.phases:
        log(f"oracle: phase {name} ({lin} in, {lout} out) alone:")

        def phase_trace(rate, lin=lin, lout=lout, name=name):
            return poisson_trace(rate, args.period_s, lin, lout, range_ratio=args.range_ratio,
                                 burstiness=args.burstiness, seed=args.seed, phase=name)
        oracle[name] = static_sweep(args, model, n, log, trace_fn=phase_trace)
    res["oracle_phases"] = {k: v["best"] for k, v in oracle.items()}

    def oracle_probe(rate):  # each phase on its best static config, attainment combined by request count
        ok = tot = 0
        for name, lin, lout in args.phases:
            b = oracle[name]["best"]
            cfg = sim_config(args, policy=b["policy"], planner=False)
            tr = poisson_trace(rate, args.period_s, lin, lout, range_ratio=args.range_ratio,
                               burstiness=args.burstiness, seed=args.seed, phase=name)
            r = simulate(model, tr, b["split"][0], b["split"][1], cfg)
            ok += r["attainment"] * r["requests"]
            tot += r["requests"]
        log(f"    oracle rate {rate:.4g}: attainment {ok / tot:.3f}")
        return ok / tot
    sr = search_goodput(oracle_probe, args.search_min_rate, args.search_max_rate, args.search_iters, ATTAINMENT)
    res["oracle"] = {"goodput": sr.goodput, "status": sr.status, "upper": sr.upper,
                     "probes": [[p.rate, p.attainment] for p in sr.probes]}
    res["oracle_sweeps"] = oracle
    return res


def validate(args, model, path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"validate: {path} does not exist")
    runs = json.loads(path.read_text())
    if not isinstance(runs, list):
        raise ValueError(f"validate: {path} must hold a JSON list of runs (see the module docstring)")
    rows = []
    keys = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
    for i, run in enumerate(runs):
        try:
            w, split, load = run["workload"], run["split"], float(run["load"])
            lin, lout = int(w["input_len"]), int(w["output_len"])
            p, d = int(split[0]), int(split[1])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ValueError(f"validate: run {i}: {e!r}: need workload.input_len/output_len, split [P, D], load") from None
        tr = poisson_trace(load, float(run.get("duration_s", 60.0)), lin, lout,
                           range_ratio=float(w.get("range_ratio", 0.0)), seed=args.seed)
        cfg = sim_config(args, policy="never" if p == 0 else "always", planner=False)
        res = simulate(model, tr, p, d, cfg)
        row = {"run": i, "workload": w, "split": [p, d], "load": load}
        for k in keys:
            sim = res[f"{k}_s"]
            meas = run.get(k)
            row[k] = {"measured": meas, "sim": sim,
                      "rel_err": (sim - meas) / meas if meas and sim is not None else None}
        rows.append(row)
    return {"runs": rows}


# ---- the command line ------------------------------------------------------------------------------
def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet_sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("run", "static-sweep", "planner", "validate", "fit"))
    ap.add_argument("file", nargs="?", help="validate: the measured results JSON; fit: the step samples JSON")
    g = ap.add_argument_group("nodes")
    g.add_argument("--node-model", choices=("fitted", "roofline"), default="roofline")
    g.add_argument("--fit-file")
    g.add_argument("--kv-bytes-per-token", type=float, default=models.kv_bytes_per_token("llama-3.1-8b"),
                   help="fitted model: KV bytes a token takes on the node (default: Llama-3.1-8B's)")
    g.add_argument("--num-blocks", type=int, default=20000, help="fitted model: KV blocks (16 tokens) a node has")
    g.add_argument("--gpu", choices=tuple(models.GPUS), default="h200")
    g.add_argument("--model-shape", choices=tuple(models.SHAPES), default="llama-3.1-8b")
    g.add_argument("--tp", type=int, default=None)
    g.add_argument("--nodes", type=int, default=8)
    g.add_argument("--gpus", type=int, default=None, help="total GPUs (nodes = GPUs / tp); overrides --nodes")
    g.add_argument("--prefill", type=int, default=None, help="run: prefill nodes at the start (default N/4)")
    g.add_argument("--chunk", type=int, default=512)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--switch-delay-s", type=float, default=1.0)
    g.add_argument("--interconnect-gbps", type=float, default=50.0, help="GB/s per node for KV hand-offs")
    g = ap.add_argument_group("router and planner")
    g.add_argument("--policy", choices=("always", "never", "auto"), default="always")
    g.add_argument("--planner", choices=("on", "off"), default="off")
    g.add_argument("--planner-interval", type=float, default=5.0)
    g.add_argument("--planner-window", type=float, default=30.0)
    g.add_argument("--planner-cooldown", type=float, default=15.0)
    g.add_argument("--heartbeat-s", type=float, default=1.0)
    g.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    g.add_argument("--slo-tpot-ms", type=float, default=50.0)
    g = ap.add_argument_group("workload")
    g.add_argument("--workload", choices=("poisson", "shifting", "azure"), default="poisson")
    g.add_argument("--rate", type=float, default=1.0)
    g.add_argument("--duration-s", type=float, default=60.0)
    g.add_argument("--input-len", type=int, default=1000)
    g.add_argument("--output-len", type=int, default=200)
    g.add_argument("--range-ratio", type=float, default=0.0)
    g.add_argument("--burstiness", type=float, default=1.0)
    g.add_argument("--period-s", type=float, default=120.0)
    g.add_argument("--phases", type=parse_phases, default=DEFAULT_PHASES, help="name:in:out,... (shifting)")
    g.add_argument("--trace", help="azure: the trace CSV")
    g.add_argument("--max-requests", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--drain-s", type=float, default=300.0)
    g = ap.add_argument_group("search and output")
    g.add_argument("--goodput-search", action="store_true")
    g.add_argument("--search-min-rate", type=float, default=1.0)
    g.add_argument("--search-max-rate", type=float, default=1024.0)
    g.add_argument("--search-iters", type=int, default=5)
    g.add_argument("--sweep-points", type=int, default=7, help="static splits tried (evenly spaced)")
    g.add_argument("--splits", type=_int_list, default=None, help="static splits tried: prefill node counts, a,b,c")
    g.add_argument("--parts", type=lambda t: t.split(","), default=["static", "planner", "oracle", "reconverge"],
                   help="planner: which of static,planner,oracle,reconverge to run")
    g.add_argument("--planner-start", default="colocated",
                   help="planner: the split it starts from: colocated, best (the best static), or a prefill count")
    g.add_argument("--out", help="the JSON summary (default: benchmarks/results/fleet_sim/<command>_....json)")
    g.add_argument("--quiet", action="store_true")
    return ap


def check_args(args) -> None:
    for name in ("chunk", "max_num_seqs", "search_iters", "sweep_points"):
        if getattr(args, name) < 1 and not (name == "search_iters" and getattr(args, name) == 0):
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("heartbeat_s", "planner_interval", "planner_window", "duration_s", "period_s", "rate",
                 "interconnect_gbps", "slo_ttft_ms", "slo_tpot_ms", "burstiness", "search_min_rate", "search_max_rate"):
        v = getattr(args, name)
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
    if args.switch_delay_s < 0:
        raise ValueError(f"--switch-delay-s must be >= 0, got {args.switch_delay_s}")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.workload == "azure" and not args.trace:
        raise ValueError("--workload azure needs --trace FILE.csv")
    if args.command in ("validate", "fit") and not args.file:
        raise ValueError(f"{args.command} needs a FILE argument")
    bad = set(args.parts) - {"static", "planner", "oracle", "reconverge"}
    if bad:
        raise ValueError(f"--parts: unknown {', '.join(sorted(bad))} (static, planner, oracle, reconverge)")
    if args.planner_start not in ("colocated", "best") and not args.planner_start.isdigit():
        raise ValueError(f"--planner-start must be colocated, best or a prefill node count, got {args.planner_start!r}")
    if args.policy != "always" and args.command == "static-sweep":
        raise ValueError("static-sweep sets the policy itself (always for splits, never for colocated)")


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        check_args(args)
        if args.command == "fit":
            samples = json.loads(Path(args.file).read_text())
            out = models.fit_samples(samples)
            text = json.dumps(out, indent=2)
            if args.out:
                Path(args.out).write_text(text + "\n")
            print(text)
            return 0
        if simpy is None:
            raise ValueError("the simulator needs simpy: pip install 'pdserve[bench]' (or pip install simpy)")
        model = node_model(args)
        n = num_nodes(args, model)
    except ValueError as e:
        ap.error(str(e))
    log = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    tag = f"{args.command}_{args.workload}_{model.name.replace(' ', '_')}_{n}n"
    result: dict = {"command": args.command, "args": {k: v for k, v in vars(args).items() if k != "phases"},
                    "phases": [list(p) for p in args.phases], "model": model.describe(), "nodes": n,
                    "gpus": n * model.gpus_per_node}
    if args.command == "run":
        p = args.prefill if args.prefill is not None else (0 if args.policy == "never" else max(1, n // 4))
        if not 0 <= p < n:
            ap.error(f"--prefill must be in [0, {n - 1}] (at least one decode node), got {p}")
        if args.goodput_search:
            result["goodput"] = goodput(args, model, (p, n - p), policy=args.policy, planner=args.planner == "on",
                                        log=log)
            print(table([result["goodput"]]))
        else:
            out, fleet = simulate(model, make_trace(args, args.rate), p, n - p, sim_config(args), keep=True)
            result["run"] = out
            if args.planner == "on":
                result["decisions"] = fleet.decisions
                result["role_changes"] = [list(c) for c in fleet.role_changes]
            print(json.dumps(out, indent=2))
    elif args.command == "static-sweep":
        result["sweep"] = static_sweep(args, model, n, log)
        print(table(result["sweep"]["rows"]))
    elif args.command == "planner":
        if args.workload != "shifting":
            ap.error("planner compares on the shifting trace: pass --workload shifting")
        r = run_planner(args, model, n, log)
        result.update(r)
        rows = list((r.get("static") or {}).get("rows", [])) + ([r["planner"]] if "planner" in r else [])
        print(table(rows))
        if "oracle" in r:
            for name, sw in r["oracle_sweeps"].items():
                print(f"\nphase {name} alone:\n" + table(sw["rows"]))
            print(f"\noracle (best static split per phase, combined): {r['oracle']['goodput']:.3g} req/s; "
                  f"per phase: {json.dumps(r['oracle_phases'])}")
        print(f"planner / best static = {r['ratios']['planner_over_best_static']}; "
              f"planner / oracle = {r['ratios']['planner_over_oracle']}")
        print("\n| shift at (s) | phase | role changes | split settled after (s) | p90s meet SLOs after (s) |")
        print("|---|---|---|---|---|")
        for s in (r.get("reconvergence_run") or {}).get("shifts", []):
            met = "never" if s["slos_met_after_s"] is None else f"{s['slos_met_after_s']:.0f}"
            print(f"| {s['shift_at_s']:.0f} | {s['phase']} | {s['role_changes']} | {s['split_settled_after_s']:.0f} | "
                  f"{met} |")
    elif args.command == "validate":
        result["validate"] = validate(args, model, args.file)
        print("| run | split | load | metric | measured | sim | rel err |\n|---|---|---|---|---|---|---|")
        for row in result["validate"]["runs"]:
            for k in ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90"):
                v = row[k]
                err = "-" if v["rel_err"] is None else f"{v['rel_err']:+.1%}"
                print(f"| {row['run']} | {row['split']} | {row['load']} | {k} | {v['measured']} | "
                      f"{_fmt(v['sim'], 1, 4)} | {err} |")
    result["wall_s"] = time.perf_counter() - t0
    print(f"\nsimulator wall time: {result['wall_s']:.1f} s", file=sys.stderr)
    out = Path(args.out) if args.out else RESULTS / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
