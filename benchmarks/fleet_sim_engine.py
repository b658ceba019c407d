"""The fleet simulator's event engine (simpy): simulated nodes around the REAL router code.

The router is `pdserve.router.registry.Registry` with a `PathPolicy`, fed Register/Heartbeat
messages; the planner is `pdserve.router.planner_loop.PlannerLoop` (hence `Planner.decide`) with a
`send` that delivers SetRole to the simulated node. See benchmarks/fleet_sim.py for the model.

Simplifications (stated): router<->node messages take no time; a request refused by the router
(429/503) is retried by its client after RETRY_S, doubling up to 8 s; a node's KV hand-offs leave one at a time over its
link (FIFO), the receiving side is not a bottleneck; a request reserves the blocks of its prompt
plus all its output tokens when it joins a decode batch; decode steps that change nothing but
the context are simulated as one event (interrupted, at a step boundary, by new work).
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field

import numpy as np
import simpy

from pdserve.protocol.messages import Heartbeat, Register, SetRole
from pdserve.router.disagg import PathPolicy
from pdserve.router.planner import Planner, PlannerConfig, WorkloadWindow
from pdserve.router.planner_loop import PlannerLoop
from pdserve.router.registry import NoNodeError, OverloadedError, Registry

RETRY_S = 0.25
MAX_STEP_SAMPLES = 64
MAX_MACRO_STEPS = 512


@dataclass(eq=False)
class SimRequest:
    rid: str
    arrival: float
    input_len: int
    output_len: int
    phase: str = ""
    first_token: float | None = None
    finish: float | None = None
    route_ids: list = field(default_factory=list)
    local: bool = False
    retries: int = 0
    # engine state
    prefill_left: int = 0
    generated: int = 0  # tokens out so far
    blocks: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass
class SimConfig:
    chunk: int = 512
    max_num_seqs: int = 256
    heartbeat_s: float = 1.0
    switch_delay_s: float = 1.0
    interconnect_Bps: float = 50e9
    policy: str = "always"
    planner: bool = False
    planner_interval_s: float = 5.0
    planner_window_s: float = 30.0
    planner_cooldown_s: float = 15.0
    slo_ttft_s: float = 1.0
    slo_tpot_s: float = 0.05
    drain_s: float = 300.0  # after the last arrival, at most this long for the rest to finish
    early_stop: float | None = None  # stop once more than this share of requests surely missed an SLO


class SimNode:
    def __init__(self, sim: Fleet, node_id: str, role: str, pid: int) -> None:
        self.sim, self.env, self.model = sim, sim.env, sim.model
        self.node_id, self.role, self.pid = node_id, role, pid
        self.changing_to = ""
        self.prefill_q: collections.deque[SimRequest] = collections.deque()  # prompts to prefill here
        self.waiting: collections.deque[SimRequest] = collections.deque()  # KV here (or local), no batch slot yet
        self.running: list[SimRequest] = []  # in the batch (prefilling locally, or decoding)
        self.incoming = 0  # hand-offs on their way here
        self.sending = 0  # hand-offs leaving from here
        self.link_free_at = 0.0
        self.used_blocks = 0
        self.samples: list[list[float]] = []
        self.wake = self.env.event()
        self.num_steps = 0
        self.busy_s = 0.0
        self.proc = self.env.process(self.loop())

    # ---- what the node holds -----------------------------------------------------------------
    def held(self) -> int:
        return len(self.prefill_q) + len(self.waiting) + len(self.running) + self.incoming + self.sending

    def request_ids(self) -> list[str]:
        return [r.rid for r in itertools.chain(self.prefill_q, self.waiting, self.running)]

    def heartbeat(self) -> Heartbeat:
        samples, self.samples = self.samples[-MAX_STEP_SAMPLES:], []
        outstanding = sum(r.prefill_left for r in self.prefill_q)
        outstanding += sum(r.prefill_left for r in self.running if r.prefill_left)
        return Heartbeat(self.node_id, self.model.num_blocks - self.used_blocks, self.model.num_blocks,
                         len(self.running), len(self.waiting) + len(self.prefill_q) + self.incoming, outstanding,
                         ready=not self.changing_to, request_ids=self.request_ids(), role=self.role,
                         step_samples=samples)

    def register_msg(self) -> Register:
        return Register(self.node_id, self.role, "sim", kv_addr=f"sim://{self.node_id}", num_total_blocks=self.model.num_blocks,
                        block_size=self.model.block_size, max_model_len=1 << 20, pid=self.pid,
                        max_num_seqs=self.sim.cfg.max_num_seqs)

    def poke(self) -> None:
        if not self.wake.triggered:
            self.wake.succeed()

    # ---- work in -------------------------------------------------------------------------------
    def take_prefill(self, req: SimRequest) -> None:
        req.prefill_left = req.input_len
        if req.local:
            self.waiting.append(req)  # a local prefill needs its batch slot and blocks first
        else:
            self.prefill_q.append(req)
        self.poke()

    def take_kv(self, req: SimRequest) -> None:
        self.incoming -= 1
        self.waiting.append(req)
        self.poke()

    def _admit(self) -> None:
        cap = self.sim.cfg.max_num_seqs
        bs = self.model.block_size
        while self.waiting and len(self.running) < cap:
            req = self.waiting[0]
            need = math.ceil((req.input_len + req.output_len) / bs)
            if self.used_blocks + need > self.model.num_blocks and self.running:
                break
            self.waiting.popleft()
            req.blocks = need
            self.used_blocks += need
            self.running.append(req)

    # ---- the engine loop -------------------------------------------------------------------------
    def loop(self):
        env, cfg = self.env, self.sim.cfg
        while True:
            self._admit()
            decoding = [r for r in self.running if not r.prefill_left]
            prefills = [r for r in self.running if r.prefill_left] + list(self.prefill_q)
            if not decoding and not prefills:
                if self.changing_to and not self.held():
                    yield from self._switch()
                    continue
                self.wake = env.event()
                yield self.wake
                continue
            b = len(decoding)
            ctx = float(sum(r.input_len + r.generated for r in decoding))
            if prefills:  # one mixed step: chunks of one or more prompts, one token per decode sequence
                budget, plan = cfg.chunk, []
                for r in prefills:
                    if budget <= 0:
                        break
                    n = min(budget, r.prefill_left)
                    plan.append((r, n))
                    budget -= n
                ptok = cfg.chunk - budget
                dt = float(self.model.step_time(float(ptok), float(b), ctx))
                start = env.now
                yield env.timeout(dt)
                self._record(ptok, b, ctx, dt)
                self.num_steps += 1
                self._decode_tokens(decoding, 1)
                for r, n in plan:
                    r.prefill_left -= n
                    if r.prefill_left == 0:
                        self._prefilled(r)
                self.busy_s += env.now - start
                continue
            # decode only: run up to k identical steps, until the first sequence ends or new work comes
            k = min(min(r.output_len - r.generated for r in decoding), MAX_MACRO_STEPS)
            times = np.asarray(self.model.step_time(0.0, float(b), ctx + b * np.arange(k, dtype=np.float64)),
                               dtype=np.float64).reshape(-1)
            if times.size == 1 and k > 1:
                times = np.full(k, times[0])
            cum = np.cumsum(times)
            start = env.now
            self.wake = env.event()
            yield env.timeout(float(cum[-1])) | self.wake
            elapsed = env.now - start
            n = k
            if elapsed < cum[-1] - 1e-12:  # woken: finish the step under way, then look again
                n = min(k, int(np.searchsorted(cum, elapsed, side="right")) + 1)
                rest = float(cum[n - 1]) - elapsed
                if rest > 0:
                    yield env.timeout(rest)
            for i in range(max(0, n - MAX_STEP_SAMPLES), n):
                self._record(0, b, ctx + b * i, float(times[i]))
            self.num_steps += n
            self.busy_s += float(cum[n - 1])
            self._decode_tokens(decoding, n)

    def _record(self, ptok, b, ctx, dt) -> None:
        self.samples.append([float(ptok), float(b), float(ctx), float(dt)])
        if len(self.samples) > 4 * MAX_STEP_SAMPLES:
            del self.samples[:-MAX_STEP_SAMPLES]

    def _decode_tokens(self, decoding: list[SimRequest], n: int) -> None:
        done = []
        for r in decoding:
            r.generated += n
            if r.generated >= r.output_len:
                done.append(r)
        for r in done:
            self.running.remove(r)
            self.used_blocks -= r.blocks
            self.sim.finished(r)

    def _prefilled(self, r: SimRequest) -> None:
        """The prompt is in: the first token goes out; a remote prefill hands the KV over."""
        r.generated = 1
        self.sim.first_token(r, self)
        if r.local:
            if r.output_len <= 1:
                self.running.remove(r)
                self.used_blocks -= r.blocks
                self.sim.finished(r)
            return
        self.prefill_q.remove(r)
        if r.output_len <= 1:
            self.sim.finished(r)
            return
        dest = self.sim.nodes[r.route_ids[1]]
        start = max(self.env.now, self.link_free_at)
        secs = r.input_len * self.model.kv_bytes_per_token / self.sim.cfg.interconnect_Bps
        self.link_free_at = start + secs
        self.sending += 1
        dest.incoming += 1
        self.env.process(self._handoff(r, dest, self.link_free_at - self.env.now))

    def _handoff(self, r: SimRequest, dest: SimNode, delay: float):
        yield self.env.timeout(delay)
        self.sending -= 1
        dest.take_kv(r)
        if self.changing_to:
            self.poke()

    # ---- role change ------------------------------------------------------------------------------
    def set_role(self, role: str) -> None:
        if role == self.role:
            self.changing_to = ""
            return
        self.changing_to = role
        self.poke()

    def _switch(self):
        yield self.env.timeout(self.sim.cfg.switch_delay_s)
        old = self.role
        self.role, self.changing_to = self.sim.role_after_switch(self), ""
        self.sim.role_switched(self, old)


class Fleet:
    def __init__(self, model, num_prefill: int, num_decode: int, cfg: SimConfig) -> None:
        self.env = simpy.Environment()
        self.model, self.cfg = model, cfg
        path = PathPolicy(cfg.policy, slo_tpot_s=cfg.slo_tpot_s if cfg.planner else None)
        self.registry = Registry(heartbeat_timeout_s=1e9, path=path)
        self.workload = WorkloadWindow(cfg.planner_window_s)
        self.planner = None
        self.loop = None
        if cfg.planner:
            pc = PlannerConfig(slo_ttft_s=cfg.slo_ttft_s, slo_tpot_s=cfg.slo_tpot_s, interval_s=cfg.planner_interval_s,
                               window_s=cfg.planner_window_s, cooldown_s=cfg.planner_cooldown_s,
                               max_nodes=num_prefill + num_decode)
            self.planner = Planner(pc)
            self.loop = PlannerLoop(self.planner, self.registry, self.workload, self._send)
        self.nodes: dict[str, SimNode] = {}
        for i in range(num_prefill + num_decode):
            role = "prefill" if i < num_prefill else "decode"
            node = SimNode(self, f"n{i:04d}", role, pid=1000 + i)
            self.nodes[node.node_id] = node
            self.registry.register(node.register_msg(), node.node_id.encode(), now=0.0)
            self.registry.heartbeat(node.heartbeat(), now=0.0)
        self.requests: list[SimRequest] = []
        self.done = 0
        self.missed = 0
        self.decisions: list[dict] = []
        self.role_changes: list[tuple[float, str, str, str]] = []
        self.num_routes = 0
        self.path_reasons: dict[str, int] = {}  # the path policy's reasons (disagg.py), counted
        self.stopped_early = False
        self._all_done = self.env.event()

    # ---- the real planner's SetRole, delivered --------------------------------------------------
    async def _send(self, node_info, msg: SetRole) -> bool:
        node = self.nodes.get(node_info.node_id)
        if node is None:
            return False
        node.set_role(msg.role)
        return True

    def role_after_switch(self, node: SimNode) -> str:
        return node.changing_to

    def role_switched(self, node: SimNode, old: str) -> None:
        self.role_changes.append((self.env.now, node.node_id, old, node.role))
        prev = self.registry.register(node.register_msg(), node.node_id.encode(), now=self.env.now)
        if prev is not None and prev.register.pid == node.pid:
            self.registry.keep_requests(prev)  # as router/handlers.py on_register
        self.registry.heartbeat(node.heartbeat(), now=self.env.now)

    # ---- processes -----------------------------------------------------------------------------
    def _heartbeats(self, node: SimNode, offset: float):
        yield self.env.timeout(offset)
        while True:
            self.registry.heartbeat(node.heartbeat(), now=self.env.now)
            yield self.env.timeout(self.cfg.heartbeat_s)

    def _planner(self):
        while True:
            yield self.env.timeout(self.cfg.planner_interval_s)
            coro = self.loop.tick(self.env.now)
            try:
                coro.send(None)
            except StopIteration as stop:
                d = stop.value
            else:  # pragma: no cover - our send never suspends
                coro.close()
                raise RuntimeError("PlannerLoop.tick suspended")
            num_p = sum(n.role == "prefill" for n in self.nodes.values())
            self.decisions.append({"t": self.env.now, "split": list(d.split), "changes": len(d.changes),
                                   "prefill_now": num_p, "reason": d.reason})

    def _arrivals(self, trace):
        env = self.env
        for i, t in enumerate(trace):
            if t.arrival_s > env.now:
                yield env.timeout(t.arrival_s - env.now)
            req = SimRequest(f"r{i}", env.now, max(1, int(t.input_len)), max(1, int(t.output_len)), t.phase)
            self.requests.append(req)
            self._submit(req)

    def _submit(self, req: SimRequest) -> None:
        reg = self.registry
        try:
            route = reg.route(range(req.input_len), req.output_len)
        except (NoNodeError, OverloadedError):
            req.retries += 1
            self.env.process(self._retry(req))
            return
        self.num_routes += 1
        reason = route.path.reason if route.path is not None else "split"
        self.path_reasons[reason] = self.path_reasons.get(reason, 0) + 1
        prefill = self.nodes[route.prefill.node_id]
        decode = self.nodes[route.decode.node_id] if route.decode is not None else prefill
        if prefill.changing_to or decode.changing_to:  # the node refuses it (switching): the router re-dispatches
            req.retries += 1
            self.env.process(self._retry(req, 0.0))
            return
        req.route_ids = route.node_ids
        req.local = route.decode is None
        reg.add_request(route, req.rid, req.input_len, req.output_len)
        self.workload.arrival(self.env.now, req.input_len, req.output_len)
        prefill.take_prefill(req)

    def _retry(self, req: SimRequest, delay: float | None = None):
        if delay is None:  # the client backs off: RETRY_S, doubling to 8 s
            delay = min(8.0, RETRY_S * 2 ** min(5, req.retries - 1))
        yield self.env.timeout(delay)
        self._submit(req)

    def first_token(self, req: SimRequest, node: SimNode) -> None:
        req.first_token = self.env.now
        self.registry.first_token(node.node_id, req.rid)
        if req.ttft > self.cfg.slo_ttft_s:
            self._miss()

    def finished(self, req: SimRequest) -> None:
        req.finish = self.env.now
        self.workload.end(self.env.now, req.output_len)
        self.registry.release_request(req.route_ids, req.rid)
        if req.ttft <= self.cfg.slo_ttft_s and req.tpot > self.cfg.slo_tpot_s:
            self._miss()
        self.done += 1
        if self.done == self.total and not self._all_done.triggered:
            self._all_done.succeed()

    def _miss(self) -> None:
        self.missed += 1
        if self.cfg.early_stop is not None and self.missed > self.cfg.early_stop * self.total:
            if not self._all_done.triggered:
                self.stopped_early = True
                self._all_done.succeed()

    def _monitor(self):
        """Early stop: requests still without a first token past the TTFT SLO have surely missed it."""
        scan = 0
        while True:
            yield self.env.timeout(1.0)
            reqs = self.requests
            while scan < len(reqs) and reqs[scan].first_token is not None:
                scan += 1
            cutoff = self.env.now - self.cfg.slo_ttft_s
            overdue = 0
            for r in itertools.islice(reqs, scan, None):
                if r.arrival >= cutoff:
                    break
                if r.first_token is None:
                    overdue += 1
            if self.missed + overdue > self.cfg.early_stop * self.total and not self._all_done.triggered:
                self.stopped_early = True
                self._all_done.succeed()

    def run(self, trace) -> None:
        trace = sorted(trace, key=lambda t: t.arrival_s)
        self.total = len(trace)
        if not trace:
            return
        for i, node in enumerate(self.nodes.values()):
            self.env.process(self._heartbeats(node, self.cfg.heartbeat_s * (i + 1) / (len(self.nodes) + 1)))
        if self.loop is not None:
            self.env.process(self._planner())
        self.env.process(self._arrivals(trace))
        if self.cfg.early_stop is not None:
            self.env.process(self._monitor())
        deadline = self.env.timeout(trace[-1].arrival_s + self.cfg.drain_s)
        self.env.run(until=self._all_done | deadline)
