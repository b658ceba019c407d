"""The router's Prometheus metrics, served at GET /metrics.

Names follow vLLM's where vLLM has the same metric (`vllm:x` → `pdserve_x`). Everything lives in
one `CollectorRegistry` per `RouterMetrics` (never prometheus_client's global one), so several
routers in one test process do not collide.

When each is recorded, and why there:

    first token delivered    TTFT and its split by stage, prompt tokens   (once per request)
    request ended            e2e latency, TPOT, ITL, generation tokens, success by finish reason
    error returned           errors by HTTP status (a 4xx/5xx response or an SSE error event)
    request re-dispatched    retries (a node died, a KV transfer failed)
    KVEvents applied         staleness (sent → applied), events, resyncs; the index's size at scrape;
                             prefix tokens: prompt, expected cached by the index at routing,
                             cached as the prefill node reported (FirstToken)
    peer refused             auth refusals by reason (control socket: unknown_key from the ZAP
                             thread, no_curve / handshake from its monitor; node_id_taken from
                             the handlers); prometheus_client counters are thread-safe
    scrape                   requests in flight, live nodes per role      (read from the router)
    saturation               loop lag (a probe every 50 ms), control backlog, requests shed with
                             a 429, and the router's own time per token by stage
                             (router/saturation.py says what the signals mean)

The per-token stage times are plain float sums on this object (`add_stage`), exported at scrape:
a prometheus_client call per stream per step would cost more than some of the stages it measures.
Seconds over tokens of one stage is the router's time per token in it:

    decode       wire bytes to a validated TokenBatch (control.py)
    detokenize   re-sequencing, detokenization, stop strings, logprobs (handlers.py)
    sse          building the events of a stream (app.py)
    write        handing them to the client's socket (app.py)

ITL is observed from `RequestTiming.token_times` when the request ends, not per token, and all
of a request's gaps at once (`BulkHistogram`): the histogram ends up the same and the per-token
path stays free of metric calls.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from pdserve.protocol.curve import AUTH_REFUSAL_REASONS
from pdserve.router.request_state import RouterRequest

# vLLM's buckets, with a few lower ones added: CPU nodes on tiny models answer in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
COMMON_ERROR_CODES = ("400", "401", "404", "413", "429", "500", "503")  # pre-created series of request_errors
TTFT_STAGES = ("router_queue", "prefill_queue", "prefill", "first_token_delivery")
ROUTER_STAGES = ("decode", "detokenize", "sse", "write")
SHED_REASONS = ("loop_lag", "control_backlog", "in_flight_limit")
STALENESS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
PREFIX_KINDS = ("prompt", "expected", "cached")
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.request_success = Counter("pdserve_request_success", "Requests ended, by finish reason "
                                       "(stop, length, abort)", ["finished_reason"], registry=r)
        self.request_errors = Counter("pdserve_request_errors", "Error responses and SSE error events the "
                                      "router sent, by HTTP status", ["code"], registry=r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival at the router to the first "
                              "token delivered", registry=r, buckets=TTFT_BUCKETS)
        self.ttft_stage = Histogram("pdserve_ttft_stage_seconds", "TTFT split by stage: router_queue, "
                                    "prefill_queue, prefill, first_token_delivery", ["stage"], registry=r,
                                    buckets=TTFT_BUCKETS)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Per request: (last token - first "
                              "token) / (output tokens - 1)", registry=r, buckets=TOKEN_BUCKETS)
        self.itl = BulkHistogram("pdserve_inter_token_latency_seconds", "Time between consecutive output tokens "
                                 "delivered in order", TOKEN_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival at the router to the end of the "
                             "request", registry=r, buckets=E2E_BUCKETS)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of requests prefilled", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Output tokens delivered to clients",
                                         registry=r)
        self.retries = Counter("pdserve_request_retries", "Requests re-dispatched after a node died or a KV "
                               "transfer failed", registry=r)
        self.auth_refusals = Counter("pdserve_auth_refusals", "Peers refused on the CURVE control socket "
                                     "(handshake attempts: unknown_key, no_curve, handshake) and node "
                                     "messages under a node id bound to another key (node_id_taken)",
                                     ["reason"], registry=r)
        for reason in AUTH_REFUSAL_REASONS:  # every series exists from the start, at 0
            self.auth_refusals.labels(reason=reason)
        for code in COMMON_ERROR_CODES:  # so error rates read 0, not "no data", before the first error
            self.request_errors.labels(code=code)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(finished_reason=reason)
        self.shed = Counter("pdserve_router_requests_shed", "New requests refused with a 429 because the "
                            "router itself was saturated, by reason (loop_lag, control_backlog, "
                            "in_flight_limit)", ["reason"], registry=r)
        for reason in SHED_REASONS:
            self.shed.labels(reason=reason)
        self.loop_lag = Histogram("pdserve_router_event_loop_lag_seconds", "How late the router's event loop "
                                  "ran a timer (probed every 50 ms)", registry=r, buckets=LAG_BUCKETS)
        self.paths = Counter("pdserve_router_prefill_path", "Requests (and re-dispatched attempts) by where "
                             "they were prefilled: remote (a prefill node, then the KV handed over) or local "
                             "(on the node that decodes them), and why (policy, length, cost, tpot_slo, "
                             "no_prefill_node, unknown_speed; classic: --disagg-policy always)",
                             ["path", "reason"], registry=r)
        self.role_changes = Counter("pdserve_router_node_role_changes", "Nodes that registered again with "
                                    "another role", ["from_role", "to_role"], registry=r)
        self.plans = Counter("pdserve_planner_decisions", "Planner ticks, by what they did (hold, role_change)",
                             ["action"], registry=r)
        self.desired = Gauge("pdserve_planner_desired_replicas", "Nodes the planner wants in each pool "
                             "(for an HPA or KEDA to act on)", ["pool"], registry=r)
        self.split = Gauge("pdserve_planner_split", "Nodes the planner wants in each role among the nodes "
                           "there are", ["role"], registry=r)
        self.kv_staleness = Histogram("pdserve_router_kv_event_staleness_seconds", "KVEvents: the node's send "
                                      "to the router's index applying them", registry=r, buckets=STALENESS_BUCKETS)
        self.kv_events = Counter("pdserve_router_kv_events", "Block keys applied to the KV index, by op "
                                 "(stored, removed)", ["op"], registry=r)
        self.kv_resyncs = Counter("pdserve_router_kv_resyncs", "Snapshots asked of nodes after a gap in their "
                                  "KV events", registry=r)
        self.prefix_tokens = Counter("pdserve_router_prefix_tokens", "Prompt tokens of routed requests "
                                     "(prompt), of those the index expected cached on the prefill node "
                                     "(expected), and cached as the prefill node reported (cached): hit rate = "
                                     "cached / prompt", ["kind"], registry=r)
        for kind in PREFIX_KINDS:
            self.prefix_tokens.labels(kind=kind)
        self.stage_seconds = dict.fromkeys(ROUTER_STAGES, 0.0)  # add_stage; exported at scrape
        self.stage_tokens = dict.fromkeys(ROUTER_STAGES, 0)

    def watch(self, num_running: Callable[[], int], node_roles: Callable[[], Iterable[tuple[str, bool]]],
              index_blocks: Callable[[], int] | None = None) -> None:
        """Scrape-time gauges: requests in flight, (role, ready) of every live node, the KV index's size."""
        self.registry.register(_RouterStateCollector(num_running, node_roles, index_blocks))

    def watch_saturation(self, saturation, control) -> None:
        """Scrape-time saturation gauges and the per-token stage counters (module docstring)."""
        self.registry.register(_SaturationCollector(self, saturation, control))

    def add_stage(self, stage: str, seconds: float, num_tokens: int) -> None:
        self.stage_seconds[stage] += seconds
        self.stage_tokens[stage] += num_tokens

    # ---- events -------------------------------------------------------------------------------
    def observe_first_token(self, req: RouterRequest) -> None:
        """Index 0 was delivered: TTFT and its stages. Stages the nodes did not report count as 0."""
        t = req.timing
        ttft = t.first_token - t.arrival
        router_queue = max(0.0, (t.dispatched or t.arrival) - t.arrival)
        parts = {"router_queue": router_queue, "prefill_queue": max(0.0, t.prefill_queued_s),
                 "prefill": max(0.0, t.prefill_s)}
        parts["first_token_delivery"] = max(0.0, ttft - sum(parts.values()))
        self.ttft.observe(ttft)
        for stage, seconds in parts.items():
            self.ttft_stage.labels(stage=stage).observe(seconds)
        self.prompt_tokens.inc(len(req.prompt_token_ids))

    def observe_end(self, req: RouterRequest, finished_reason: str | None) -> None:
        """The request ended. `finished_reason` None means it failed (counted by `observe_error`):
        its tokens still count, its latencies do not."""
        t = req.timing
        num_out = len(req.output_token_ids)
        self.generation_tokens.inc(num_out)
        times = t.token_times
        self.itl.observe_many([cur - prev for prev, cur in zip(times, times[1:])])
        if finished_reason is None:
            return
        self.request_success.labels(finished_reason=finished_reason).inc()
        if t.finished is not None:
            self.e2e.observe(t.finished - t.arrival)
        if num_out >= 2:
            self.tpot.observe((t.token_times[-1] - t.token_times[0]) / (num_out - 1))

    def observe_retry(self) -> None:
        self.retries.inc()

    def observe_auth_refusal(self, reason: str) -> None:
        """Any thread (the ZAP authenticator's included)."""
        self.auth_refusals.labels(reason=reason).inc()

    def observe_error(self, status: int) -> None:
        self.request_errors.labels(code=str(status)).inc()

    def observe_shed(self, reason: str) -> None:
        self.shed.labels(reason=reason).inc()

    def observe_path(self, route) -> None:
        """A request's route (registry.Route): where it is prefilled and why."""
        path = "local" if route.local else "remote"
        reason = route.path.reason if route.path is not None else ("colocated" if route.local else "classic")
        self.paths.labels(path=path, reason=reason).inc()
        if route.prompt_tokens:
            self.prefix_tokens.labels(kind="prompt").inc(route.prompt_tokens)
            self.prefix_tokens.labels(kind="expected").inc(route.cached_tokens)

    def observe_cached(self, num_cached_tokens: int) -> None:
        """The prefill node's FirstToken: prompt tokens its cache held."""
        if num_cached_tokens > 0:
            self.prefix_tokens.labels(kind="cached").inc(num_cached_tokens)

    def observe_kv_events(self, msg) -> None:
        """A KVEvents applied to the index: its keys, and its age (the node's send to now)."""
        if msg.stored:
            self.kv_events.labels(op="stored").inc(len(msg.stored))
        if msg.removed:
            self.kv_events.labels(op="removed").inc(len(msg.removed))
        if msg.sent_at:
            self.kv_staleness.observe(max(0.0, time.time() - msg.sent_at))

    def observe_resync(self) -> None:
        self.kv_resyncs.inc()

    def observe_role_change(self, from_role: str, to_role: str) -> None:
        self.role_changes.labels(from_role=from_role, to_role=to_role).inc()

    def observe_plan(self, decision) -> None:
        """A planner tick's decision (planner.Decision)."""
        self.plans.labels(action="role_change" if decision.changes else "hold").inc()
        for pool, n in decision.desired.items():
            self.desired.labels(pool=pool).set(n)
        for role, n in zip(("prefill", "decode"), decision.split):
            self.split.labels(role=role).set(n)


class BulkHistogram:
    """A histogram observed many values at a time (a request's inter-token gaps at its end): one
    bisect per value, no lock, exported at scrape. prometheus_client's Histogram costs a lock and
    a linear bucket scan per value, too much to pay at every streamed token. Single-threaded use (the event loop), like the rest of the router."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last one: +Inf
        self.sum = 0.0

    def observe_many(self, values: list[float]) -> None:
        counts, bounds = self.counts, self.bounds
        for v in values:
            counts[bisect.bisect_left(bounds, v)] += 1  # a value on a bound counts in that bucket (le)
        self.sum += sum(values)

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([], buckets, self.sum)
        yield family


class _RouterStateCollector:
    """Gauges read from the router at scrape time (a prometheus_client custom collector)."""

    def __init__(self, num_running: Callable[[], int],
                 node_roles: Callable[[], Iterable[tuple[str, bool]]], index_blocks: Callable[[], int] | None) -> None:
        self._num_running = num_running
        self._node_roles = node_roles
        self._index_blocks = index_blocks

    def collect(self):
        running = GaugeMetricFamily("pdserve_num_requests_running", "Requests in flight at the router "
                                    "(dispatched, not ended)")
        running.add_metric([], self._num_running())
        yield running
        live, ready = Tally(), Tally()
        for role, is_ready in self._node_roles():
            live[role] += 1
            ready[role] += is_ready
        for name, doc, tally in (("pdserve_nodes", "Live (registered) nodes per role", live),
                                 ("pdserve_nodes_ready", "Live nodes per role taking requests", ready)):
            family = GaugeMetricFamily(name, doc, labels=["role"])
            for role in ("prefill", "decode", "both"):
                family.add_metric([role], tally[role])
            yield family
        if self._index_blocks is not None:
            index = GaugeMetricFamily("pdserve_router_kv_index_blocks", "Entries of the KV index: (node, tier, "
                                      "block) the nodes' caches hold, from their KV events")
            index.add_metric([], self._index_blocks())
            yield index


class _SaturationCollector:
    """The router's own saturation (router/saturation.py) and its time per token by stage."""

    def __init__(self, metrics: RouterMetrics, saturation, control) -> None:
        self._metrics, self._saturation, self._control = metrics, saturation, control

    def collect(self):
        sat, control = self._saturation, self._control
        for name, doc, value in (
                ("pdserve_router_loop_lag_seconds", "The event loop's worst lag over the last second", sat.loop_lag_s()),
                ("pdserve_router_control_backlog", "Node messages read off the control socket, not yet handled",
                 len(control.backlog)),
                ("pdserve_router_control_backlog_age_seconds", "How long the oldest of them has waited",
                 control.backlog_age_s()),
                ("pdserve_router_in_flight_limit", "Requests in flight the router admits while it recovers "
                 "from an overload (0: no limit)", sat.limit or 0),
                ("pdserve_router_event_loop_busy_ratio", "CPU seconds the event-loop thread spent per wall second "
                 "over the last probes: lag with a low ratio is other processes' load, not the router's",
                 sat.busy_ratio())):
            gauge = GaugeMetricFamily(name, doc)
            gauge.add_metric([], value)
            yield gauge
        for name, doc, values in (
                ("pdserve_router_token_stage_seconds", "Router time spent on streamed tokens, by stage "
                 "(decode, detokenize, sse, write); over pdserve_router_token_stage_tokens: time per token",
                 self._metrics.stage_seconds),
                ("pdserve_router_token_stage_tokens", "Tokens through each stage", self._metrics.stage_tokens)):
            family = CounterMetricFamily(name, doc, labels=["stage"])
            for stage in ROUTER_STAGES:
                family.add_metric([stage], values[stage])
            yield family
