"""The per-request prefill path (disagg.py), the online speed fit (speed.py), the planner
(planner.py) and its loop in the router (planner_loop.py): pure policy code, no sockets."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from pdserve.protocol.messages import Heartbeat, Register, SetRole
from pdserve.router.disagg import NodeLoad, PathPolicy
from pdserve.router.planner import FleetNode, Planner, PlannerConfig, Workload, WorkloadWindow, predict
from pdserve.router.planner_loop import PlannerLoop
from pdserve.router.registry import Registry
from pdserve.router.speed import MIN_SAMPLES, StepModel

TRUE = (0.004, 3e-4, 5e-4, 1e-6)  # c0, c1 (prefill token), c2 (sequence), c3 (context token)


def steps(coef=TRUE, n=64, seed=0, noise=0.0) -> list[list[float]]:
    """Step samples of a node whose step time is `coef`: half prefill chunks, half decode steps."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prefill = float(rng.integers(16, 512)) if i % 2 == 0 else 0.0
        seqs = float(rng.integers(1, 32))
        ctx = seqs * float(rng.integers(50, 800))
        secs = coef[0] + coef[1] * prefill + coef[2] * seqs + coef[3] * ctx
        out.append([prefill, seqs, ctx, secs * (1 + noise * rng.standard_normal())])
    return out


def known_model(coef=TRUE) -> StepModel:
    m = StepModel()
    m.add(steps(coef))
    return m


# ---- speed.py ------------------------------------------------------------------------------------
def test_the_fit_recovers_the_step_time_it_was_fed():
    m = known_model()
    assert m.known
    assert np.allclose(m.coefficients(), TRUE, rtol=0.05, atol=1e-6)
    assert m.step_s(256, 8, 8 * 400) == pytest.approx(TRUE[0] + TRUE[1] * 256 + TRUE[2] * 8 + TRUE[3] * 3200, rel=0.02)


def test_the_fit_is_unknown_until_both_kinds_of_step_were_seen_and_ignores_garbage():
    m = StepModel()
    m.add([[0, 4, 400, 0.01]] * (MIN_SAMPLES * 2))  # decode only
    assert not m.known
    m.add([[float("nan"), 1, 1, 1], [1, 1, 1, -1], [1, 1, 1, 0]])  # garbled: dropped
    assert m.num_samples == MIN_SAMPLES * 2
    m.add([[128, 0, 0, 0.05]] * MIN_SAMPLES)
    assert m.known and m.chunk >= 128
    assert all(c >= 0 for c in m.coefficients())


def test_a_run_of_one_kind_of_step_does_not_flush_the_other():
    m = StepModel(window=64)
    m.add([[256.0, 0.0, 0.0, TRUE[0] + TRUE[1] * 256]] * 16)  # a prefill node's steps
    m.add([[0.0, 8.0, 3200.0, TRUE[0] + TRUE[2] * 8 + TRUE[3] * 3200]] * 1000)  # many decode nodes' steps
    assert m.known and m.num_samples == 16 + 64


def test_a_colocated_nodes_mixed_steps_make_its_speed_known():
    m = StepModel()
    m.add([s for s in steps(n=64) if s[0] > 0])  # every step a chunk beside a running batch
    assert m.known


def test_noisy_steps_still_fit_within_a_few_percent():
    m = StepModel()
    m.add(steps(n=512, noise=0.05))
    assert m.prefill_s(1000, chunk=512) == pytest.approx(2 * TRUE[0] + TRUE[1] * 1000, rel=0.1)


# ---- disagg.py -------------------------------------------------------------------------------
def load(node_id, model, outstanding=0, running=0, ctx=0.0) -> NodeLoad:
    return NodeLoad(node_id, model, outstanding, running, ctx)


def test_fixed_policies_and_the_length_rule():
    d, p = load("d", known_model()), load("p", known_model())
    assert not PathPolicy("always").choose(100, d, p).local
    assert PathPolicy("never").choose(100, d, p).local
    assert PathPolicy("always").choose(100, d, None).local  # no prefill node at all: the decode node
    rule = PathPolicy("auto", local_prefill_max_tokens=64)
    assert rule.choose(64, d, p).local and not rule.choose(65, d, p).local
    with pytest.raises(ValueError, match="disagg-policy"):
        PathPolicy("sometimes")


def test_auto_goes_local_when_the_prefill_queue_is_long_and_remote_when_it_is_idle():
    policy = PathPolicy("auto")
    d = load("d", known_model(), running=4, ctx=4 * 300.0)
    idle = load("p", known_model())
    busy = load("p", known_model(), outstanding=20_000)
    assert not policy.choose(500, d, idle).local
    choice = policy.choose(500, d, busy)
    assert choice.local and choice.reason == "cost" and choice.local_ttft_s < choice.remote_ttft_s


def test_auto_never_guesses_an_unknown_decode_node_and_keeps_the_tpot_slo():
    busy = load("p", known_model(), outstanding=20_000)
    assert PathPolicy("auto").choose(100, load("d", StepModel()), busy).reason == "unknown_speed"
    slow_batch = load("d", known_model(), running=200, ctx=200 * 800.0)  # a chunk on top would break 50 ms
    choice = PathPolicy("auto", slo_tpot_s=0.05).choose(500, slow_batch, busy)
    assert not choice.local and choice.reason == "tpot_slo"


def register(reg: Registry, node_id: str, role: str, *, samples=None, pid: int = 1, running: int = 0) -> None:
    reg.register(Register(node_id, role, "m", kv_addr=f"tcp://{node_id}", num_total_blocks=1000, block_size=16,
                          pid=pid), node_id.encode(), now=0.0)
    reg.heartbeat(Heartbeat(node_id, 1000, 1000, running, 0, role=role, step_samples=samples or []), now=0.0)


def test_registry_routes_by_path_and_counts_a_local_prefill_on_the_decode_node():
    reg = Registry(path=PathPolicy("never"))
    register(reg, "p", "prefill")
    register(reg, "d", "decode")
    route = reg.route(list(range(50)), 16)
    assert route.local and route.prefill.node_id == "d" and route.node_ids == ["d"]
    reg.add_request(route, "r1", 50, 16)
    assert reg.nodes["d"].prefill_load == 50 and "r1" in reg.nodes["d"].request_ids
    reg.first_token("d", "r1")
    reg.release_request(route.node_ids, "r1")
    assert reg.nodes["d"].prefill_load == 0 and not reg.nodes["d"].request_ids


def test_decode_only_fleets_are_healthy_unless_the_policy_is_always():
    for policy, healthy in (("always", False), ("auto", True), ("never", True)):
        reg = Registry(path=PathPolicy(policy))
        register(reg, "d", "decode")
        assert reg.is_healthy() is healthy


def test_heartbeat_samples_feed_the_speed_which_survives_a_role_change():
    reg = Registry(path=PathPolicy("auto"))
    register(reg, "n", "decode", samples=steps(n=64))
    assert reg.nodes["n"].speed.known
    register(reg, "n", "prefill")  # re-registered with another role: the same machine
    assert reg.nodes["n"].speed.known and reg.nodes["n"].role == "prefill"


# ---- planner.py ------------------------------------------------------------------------------
CPU = (0.02, 2e-4, 1e-3, 1e-7)


def test_predictions_grow_with_load_and_become_infeasible_past_capacity():
    light, heavy = Workload(0.5, 500, 100, 10), Workload(3.0, 500, 100, 10)
    a = predict(CPU, light, 1, 1, slo_ttft_s=1, slo_tpot_s=0.05)
    b = predict(CPU, heavy, 1, 1, slo_ttft_s=1, slo_tpot_s=0.05)
    assert a.ttft_p90_s < b.ttft_p90_s and a.tpot_s <= b.tpot_s
    over = predict(CPU, Workload(100.0, 500, 100, 10), 1, 1, slo_ttft_s=1, slo_tpot_s=0.05)
    assert math.isinf(over.ttft_p90_s) and over.score >= 1e8
    assert predict(CPU, light, 2, 0, slo_ttft_s=1, slo_tpot_s=0.05).score >= 1e8  # no decode node


def model_of(coef) -> StepModel:
    m = StepModel()
    m.add(steps(coef, n=128))
    return m


def test_planner_moves_nodes_towards_prefill_for_long_prompts_and_back_for_long_outputs():
    # colocated, the long prompts' chunks stretch every decode step past the 25 ms TPOT target
    cfg = PlannerConfig(slo_ttft_s=8.0, slo_tpot_s=0.025, cooldown_s=0.0, max_change_fraction=0.25)
    planner = Planner(cfg)
    models = [model_of(CPU)] * 8
    nodes = [FleetNode(f"n{i}", "decode", load=i) for i in range(8)]
    long_prompts = Workload(3.0, 3000, 100, 100)
    d = planner.decide(0.0, nodes, long_prompts, models, chunk=512)
    assert d.changes and all(role == "prefill" for _, role in d.changes), d.reason
    # colocated misses the TPOT target and the best split meets both: all the way, least loaded first
    best = min(d.predictions, key=lambda p: p.score)
    assert d.split == (best.prefill, best.decode) and [n for n, _ in d.changes] == [f"n{i}" for i in range(best.prefill)]
    p = sum(1 for _, r in d.changes if r == "prefill")
    nodes = [FleetNode(f"n{i}", "prefill" if i < 4 else "decode") for i in range(8)]
    long_outputs = Workload(2.0, 100, 1000, 100)
    planner.config.slo_tpot_s = 0.1
    d2 = planner.decide(10.0, nodes, long_outputs, models, chunk=512)
    assert d2.changes and all(role == "decode" for _, role in d2.changes), d2.reason
    assert p >= 1


def test_planner_holds_without_data_within_its_cooldown_and_when_the_gain_is_small():
    cfg = PlannerConfig(slo_ttft_s=2.0, slo_tpot_s=0.1, cooldown_s=30.0)
    planner = Planner(cfg)
    nodes = [FleetNode("a", "decode"), FleetNode("b", "decode")]
    assert planner.decide(0.0, nodes, Workload(1.0, 3000, 20, 10), [StepModel()]).reason.startswith("no node")
    models = [model_of(CPU)]
    assert "no requests" in planner.decide(0.0, nodes, Workload(0, 0, 0, 0), models).reason
    cfg.slo_ttft_s, cfg.slo_tpot_s = 8.0, 0.025
    first = planner.decide(0.0, nodes, Workload(1.0, 3000, 100, 100), models, chunk=512)
    assert first.changes
    moved = [FleetNode("a", "prefill"), FleetNode("b", "decode")]
    small_gain = planner.decide(5.0, moved, Workload(0.05, 100, 1000, 100), models, chunk=512)
    assert not small_gain.changes and "cooling down" not in small_gain.reason  # 0.82 against 0.84: noise
    big_gain = planner.decide(5.0, moved, Workload(0.5, 100, 1000, 100), models, chunk=512)
    assert not big_gain.changes and "cooling down" in big_gain.reason
    assert planner.decide(31.0, moved, Workload(0.5, 100, 1000, 100), models, chunk=512).changes == [("a", "decode")]


def test_desired_pool_sizes_grow_with_the_load_and_stop_where_more_nodes_stop_helping():
    planner = Planner(PlannerConfig(slo_ttft_s=8.0, slo_tpot_s=0.025, max_nodes=64))
    models = [model_of(CPU)]
    nodes = [FleetNode("a", "decode"), FleetNode("b", "decode")]
    def settled(workload):
        return [planner.decide(float(t), nodes, workload, models, chunk=512).desired for t in range(3)]

    small = settled(Workload(0.05, 100, 1000, 10))
    assert small[0] == small[1] == {} and small[2]  # published once computed 3 ticks in a row
    big = settled(Workload(3.0, 3000, 100, 10))
    assert big[0] == big[1] == small[2]  # the old size holds until the new one is stable
    assert sum(small[2].values()) <= 4 < sum(big[2].values()) < 64, (small, big)
    flood = settled(Workload(1000.0, 3000, 100, 10))[2]  # beyond any fleet: all of it, not the smallest
    assert sum(flood.values()) == 64


def test_workload_window_forgets_old_traffic():
    w = WorkloadWindow(window_s=10.0)
    for t in range(20):
        w.arrival(float(t), 100, 50)
    w.end(19.0, 40)
    snap = w.snapshot(20.0)
    assert snap.num_requests == 10 and snap.rate == pytest.approx(1.0) and snap.output_tokens == 40
    assert w.snapshot(100.0).num_requests == 0


def test_the_loop_sends_set_role_and_marks_the_node_until_it_registers_again():
    reg = Registry(path=PathPolicy("auto"))
    for i in range(4):
        register(reg, f"n{i}", "decode", samples=steps(CPU, n=64, seed=i))
    window = WorkloadWindow(30.0)
    for t in range(9):  # 1.5 requests/s over 6 s
        window.arrival(t * 0.66, 3000, 100)
    sent: list[tuple[str, SetRole]] = []

    async def send(node, msg):
        sent.append((node.node_id, msg))
        return True

    config = PlannerConfig(slo_ttft_s=8.0, slo_tpot_s=0.025, cooldown_s=0.0)
    loop = PlannerLoop(Planner(config), reg, window, send)
    decision = asyncio.run(loop.tick(now=6.0))
    assert sent and all(isinstance(m, SetRole) and m.role == "prefill" for _, m in sent)
    node_id = sent[0][0]
    assert reg.nodes[node_id].changing_to == "prefill"
    assert loop.status()["changes"] == [list(c) for c in decision.changes]
    register(reg, node_id, "prefill")  # it registered again with the new role
    assert reg.nodes[node_id].changing_to == "" and reg.nodes[node_id].role == "prefill"


def test_a_split_fleet_knows_its_speed_from_both_kinds_of_node_and_auto_uses_it():
    """A prefill node reports only prefill steps and a decode node only decode steps: neither's
    own fit is known, the pooled fleet fit is, and auto decides with it."""
    reg = Registry(path=PathPolicy("auto"))
    samples = steps(CPU, n=128)
    register(reg, "p", "prefill", samples=[[s[0], 0.0, 0.0, CPU[0] + CPU[1] * s[0]] for s in samples if s[0] > 0])
    register(reg, "d", "decode", samples=[[0.0, *s[1:3], CPU[0] + CPU[2] * s[1] + CPU[3] * s[2]] for s in samples
                                           if s[0] == 0])
    assert not reg.nodes["p"].speed.known and not reg.nodes["d"].speed.known and reg.fleet_speed.known
    reg.nodes["p"].outstanding_prompt_tokens["queued"] = 50_000  # a long prefill queue: local pays
    route = reg.route(list(range(300)), 16)
    assert route.local and route.path.reason == "cost", route.path
    reg.nodes["p"].outstanding_prompt_tokens.clear()
    # an idle prefill node against a decode node with a batch to run beside the chunks: remote
    reg.heartbeat(Heartbeat("d", 1000, 1000, 8, 0, role="decode"), now=0.0)
    reg.nodes["d"].request_ids.update(f"r{i}" for i in range(8))
    assert not reg.route(list(range(300)), 16).local


def test_the_tpot_guard_spreads_a_chunk_over_the_output_and_yields_to_a_sure_ttft_miss():
    d = load("d", known_model(), running=8, ctx=8 * 300.0)
    busy = load("p", known_model(), outstanding=20_000)
    idle = load("p", known_model())
    # one 512-token chunk step is ~0.16 s, over a 50 ms target; spread over 1000 output tokens it is not
    long_out = PathPolicy("auto", slo_tpot_s=0.05, expected_output_tokens=1000)
    assert long_out.choose(512, d, busy).reason == "cost"
    short_out = PathPolicy("auto", slo_tpot_s=0.05, expected_output_tokens=4)
    assert short_out.choose(512, d, idle).reason == "tpot_slo"
    rescue = PathPolicy("auto", slo_tpot_s=0.05, slo_ttft_s=1.0, expected_output_tokens=4)
    choice = rescue.choose(512, d, busy)  # remote TTFT ~6 s: a sure miss; local meets 1 s
    assert choice.local and choice.reason == "ttft_slo" and choice.remote_ttft_s > 1.0 >= choice.local_ttft_s
