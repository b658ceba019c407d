"""The planner: how many of the nodes should prefill and how many decode, for the SLOs given.

Every `interval_s` the router's `PlannerLoop` (router/planner_loop.py) hands `Planner.decide`
the live nodes (role, load), the fleet's fitted step time (router/speed.py) and the workload the router saw over the
last `window_s` (arrival rate, prompt and output lengths: `WorkloadWindow`). No profiling step:
the speed is whatever the nodes' own steps showed.

For each split of the N nodes into p prefill and d = N - p decode nodes it predicts the p90 TTFT
and the mean TPOT from the fleet's fitted step time

    step(prefill tokens x, sequences b, context c) = c0 + c1 x + c2 b + c3 c

  p > 0 (prefill nodes prefill, decode nodes decode):
    prefill service s = step time of a prompt alone, utilisation rho = rate * s / p;
    TTFT p90 = s + 2.3 * s * rho / (1 - rho)              (the mean M/M/1 wait; 2.3 = ln 10)
    a decode node's batch b = (rate / d) * out * TPOT (Little), TPOT = c0 + k b, k = c2 + c3 ctx,
    so TPOT = c0 / (1 - a k) with a = rate * out / d; infeasible when a k >= 1 or b > max_num_seqs
  p = 0 (every node prefills what it decodes: colocated per request):
    prefill work takes u = c1 * (rate / d) * in of each node's time, so
    TPOT = c0 / (1 - u - a k), and TTFT p90 = chunks * TPOT, stretched by the prefill queue

A split's score is max(TTFT p90 / SLO_ttft, TPOT / SLO_tpot): at most 1 meets both SLOs, lower
is more headroom. The planner wants the split with the lowest score. It acts only when that
split's score is lower than the current one's by `hysteresis` (or the current one misses an SLO
and the other does not), no sooner than `cooldown_s` after its last change. It moves all the way
when the current split misses the SLOs and the best meets them; otherwise half the way (at least
`max_change_fraction` of the fleet, at least one node), so a noisy estimate moves it less.

With a scaler (router/scaling.py) it also says how many nodes each pool should have: the fewest
nodes whose best split scores at most `target_score` (headroom for bursts), between the
configured bounds; when no size gets there, the fewest within 5% of the largest fleet's score
(all of them when even the largest cannot keep up). A new size is published only once
DESIRED_STABLE_TICKS ticks in a row computed it: starting or stopping a node costs far more
than a tick's noise is worth.

`decide` is a pure function of its inputs plus the planner's memory of its last change, so the
fleet simulator (benchmarks/fleet_sim.py) runs this exact code against simulated nodes.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.router.speed import StepModel

ROLES = ("prefill", "decode")
P90_WAIT = math.log(10)  # an exponential wait's p90 over its mean
INFEASIBLE = 1e9
DESIRED_STABLE_TICKS = 3  # ticks in a row a pool size must be computed before it is published


@dataclass
class PlannerConfig:
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    interval_s: float = 5.0
    window_s: float = 30.0
    cooldown_s: float = 15.0
    hysteresis: float = 0.15  # a split must score this much lower (relative) to be worth a role change
    max_change_fraction: float = 0.125  # nodes moved per interval, as a fraction of the fleet (at least 1)
    min_prefill: int = 0
    min_decode: int = 1
    target_score: float = 0.8  # scaling: the pools' size for this much headroom
    min_nodes: int = 1
    max_nodes: int = 64

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_tpot_s", "interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"planner: {name} must be > 0, got {getattr(self, name)}")
        if self.min_decode < 1:
            raise ValueError("planner: at least one decode node is needed (min_decode >= 1)")


@dataclass(frozen=True)
class FleetNode:
    node_id: str
    role: str  # "prefill" or "decode" ("both" nodes are not the planner's to move)
    load: int = 0  # requests it holds: the planner moves the least loaded
    max_num_seqs: int = 256


@dataclass(frozen=True)
class Workload:
    rate: float  # requests per second
    prompt_tokens: float  # mean
    output_tokens: float  # mean
    num_requests: int = 0  # in the window


@dataclass(frozen=True)
class Prediction:
    prefill: int
    decode: int
    ttft_p90_s: float
    tpot_s: float
    score: float


@dataclass
class Decision:
    split: tuple[int, int]  # (prefill, decode) wanted among the nodes there are
    changes: list[tuple[str, str]] = field(default_factory=list)  # (node id, new role)
    desired: dict[str, int] = field(default_factory=dict)  # pool sizes wanted (scaling)
    reason: str = ""
    predictions: list[Prediction] = field(default_factory=list)


class WorkloadWindow:
    """What the router saw over the last `window_s`: arrivals with their prompt lengths, and the
    output lengths of the requests that ended."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._arrivals: collections.deque[tuple[float, int, int]] = collections.deque()  # (t, prompt, max_tokens)
        self._ends: collections.deque[tuple[float, int]] = collections.deque()  # (t, output tokens)
        self._start: float | None = None

    def arrival(self, now: float, prompt_tokens: int, max_tokens: int) -> None:
        if self._start is None:
            self._start = now
        self._arrivals.append((now, prompt_tokens, max_tokens))

    def end(self, now: float, output_tokens: int) -> None:
        self._ends.append((now, output_tokens))

    def snapshot(self, now: float) -> Workload:
        cutoff = now - self.window_s
        for q in (self._arrivals, self._ends):
            while q and q[0][0] < cutoff:
                q.popleft()
        n = len(self._arrivals)
        if n == 0 or self._start is None:
            return Workload(0.0, 0.0, 0.0, 0)
        span = max(1e-3, min(self.window_s, now - self._start))
        prompt = sum(a[1] for a in self._arrivals) / n
        if self._ends:
            output = sum(e[1] for e in self._ends) / len(self._ends)
        else:  # nothing ended yet: what they asked for, an upper bound
            output = sum(a[2] for a in self._arrivals) / n
        return Workload(n / span, prompt, max(1.0, output), n)


def fleet_coefficients(models: Sequence[StepModel]) -> np.ndarray | None:
    """The mean of the known fits among `models` (None: none known). The router passes one, the
    fit over every node's steps pooled (registry.fleet_speed)."""
    known = [m.coefficients() for m in models if m.known]
    return np.mean(known, axis=0) if known else None


def predict(coef: Sequence[float], workload: Workload, prefill: int, decode: int, *, slo_ttft_s: float,
            slo_tpot_s: float, chunk: int = 256, max_num_seqs: int = 256) -> Prediction:
    """TTFT p90 and TPOT of `workload` on `prefill` + `decode` nodes (module docstring)."""
    c0, c1, c2, c3 = (float(x) for x in coef)
    rate, lin, lout = workload.rate, workload.prompt_tokens, workload.output_tokens
    if decode < 1:
        return Prediction(prefill, decode, math.inf, math.inf, INFEASIBLE)
    ctx = lin + lout / 2
    k = c2 + c3 * ctx
    a = rate * lout / decode
    chunks = max(1, math.ceil(lin / max(1, chunk)))
    if prefill > 0:
        service = chunks * (c0 + c2) + c1 * lin  # a prompt alone, in its chunks
        rho = rate * service / prefill
        ttft = service + P90_WAIT * service * rho / (1 - rho) if rho < 1 else math.inf
        tpot = c0 / (1 - a * k) if a * k < 1 else math.inf
    else:
        u = c1 * rate * lin / decode
        free = 1 - u - a * k
        tpot = c0 / free if free > 0 else math.inf
        # a prompt's chunks ride the node's steps; the prompts queue for the steps' token budget
        service = chunks * tpot + c1 * lin  # its steps, each slower by its own chunk's tokens
        rho = (rate / decode) * lin * tpot / max(1, chunk) if math.isfinite(tpot) else 1.0
        ttft = service + P90_WAIT * service * rho / (1 - rho) if rho < 1 else math.inf
    if math.isfinite(tpot) and a * tpot > max_num_seqs:  # the batch a node would need exceeds its limit
        tpot = math.inf
    score = max(ttft / slo_ttft_s, tpot / slo_tpot_s)
    return Prediction(prefill, decode, ttft, tpot, min(score, INFEASIBLE))


class Planner:
    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config if config is not None else PlannerConfig()
        self.last_change: float | None = None
        self.num_decisions = 0
        self.desired: dict[str, int] = {}  # the pool sizes published (stable: see the module docstring)
        self._candidate: dict[str, int] = {}
        self._candidate_ticks = 0

    def splits(self, coef, workload: Workload, num_nodes: int, *, chunk: int = 256,
               max_num_seqs: int = 256) -> list[Prediction]:
        cfg = self.config
        out = []
        for p in range(cfg.min_prefill, num_nodes - cfg.min_decode + 1):
            out.append(predict(coef, workload, p, num_nodes - p, slo_ttft_s=cfg.slo_ttft_s,
                               slo_tpot_s=cfg.slo_tpot_s, chunk=chunk, max_num_seqs=max_num_seqs))
        return out

    def decide(self, now: float, nodes: Sequence[FleetNode], workload: Workload, models: Sequence[StepModel],
               *, chunk: int = 256) -> Decision:
        cfg = self.config
        movable = [n for n in nodes if n.role in ROLES]
        num_p = sum(n.role == "prefill" for n in movable)
        current = (num_p, len(movable) - num_p)
        coef = fleet_coefficients(models)
        if coef is None:
            return Decision(current, reason="no node's speed is known yet")
        if workload.num_requests == 0:
            return Decision(current, reason="no requests in the window")
        max_seqs = min((n.max_num_seqs for n in movable), default=256)
        preds = self.splits(coef, workload, len(movable), chunk=chunk, max_num_seqs=max_seqs)
        decision = Decision(current, predictions=preds, desired=self._publish(self._desired(coef, workload, chunk,
                                                                                            max_seqs)))
        if not preds:
            decision.reason = "too few nodes to split"
            return decision
        best = min(preds, key=lambda p: (p.score, abs(p.prefill - num_p)))
        now_pred = next((p for p in preds if p.prefill == num_p), None)
        now_score = now_pred.score if now_pred is not None else INFEASIBLE
        decision.reason = (f"best {best.prefill}P+{best.decode}D score {best.score:.2f} "
                           f"(TTFT p90 {best.ttft_p90_s * 1e3:.0f} ms, TPOT {best.tpot_s * 1e3:.1f} ms); "
                           f"now {num_p}P+{current[1]}D score {now_score:.2f}")
        worth = best.score < now_score * (1 - cfg.hysteresis) or (now_score > 1 >= best.score)
        if best.prefill == num_p or not worth:
            return decision
        if self.last_change is not None and now - self.last_change < cfg.cooldown_s:
            decision.reason += "; cooling down"
            return decision
        full = best.prefill - num_p
        if now_score > 1 >= best.score:  # missing the SLOs now, and the best split would not: all the way
            step = abs(full)
        else:  # half the way (at least max_change_fraction of the fleet): a noisy estimate moves less
            step = max(1, int(cfg.max_change_fraction * len(movable)), math.ceil(abs(full) / 2))
        delta = max(-step, min(step, full))
        src, dst = ("decode", "prefill") if delta > 0 else ("prefill", "decode")
        victims = sorted((n for n in movable if n.role == src), key=lambda n: (n.load, n.node_id))[:abs(delta)]
        decision.split = (num_p + delta, current[1] - delta)
        decision.changes = [(n.node_id, dst) for n in victims]
        self.last_change = now
        self.num_decisions += 1
        return decision

    def _publish(self, computed: dict[str, int]) -> dict[str, int]:
        if computed == self._candidate:
            self._candidate_ticks += 1
        else:
            self._candidate, self._candidate_ticks = computed, 1
        if self._candidate_ticks >= DESIRED_STABLE_TICKS:
            self.desired = dict(computed)
        return self.desired

    def _desired(self, coef, workload: Workload, chunk: int, max_seqs: int) -> dict[str, int]:
        """The smallest fleet whose best split scores at most target_score; when no size gets
        there (a TPOT floor above the SLO, say), the smallest within 5% of the largest's score."""
        cfg = self.config
        best_by_size = {}
        for n in range(max(cfg.min_nodes, cfg.min_prefill + cfg.min_decode), cfg.max_nodes + 1):
            preds = self.splits(coef, workload, n, chunk=chunk, max_num_seqs=max_seqs)
            if preds:
                best_by_size[n] = min(preds, key=lambda p: p.score)
        if not best_by_size:
            return {}
        largest = best_by_size[max(best_by_size)]
        if largest.score >= INFEASIBLE:  # even the largest fleet cannot keep up: all of it
            return {"prefill": largest.prefill, "decode": largest.decode}
        good_enough = max(cfg.target_score, largest.score * 1.05)
        best = next(p for p in best_by_size.values() if p.score <= good_enough)
        return {"prefill": best.prefill, "decode": best.decode}
