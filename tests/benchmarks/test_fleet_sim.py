"""The fleet simulator (benchmarks/fleet_sim.py): its nodes, and that it drives the real router code."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("simpy", reason="the fleet simulator needs simpy (pip install 'pdserve[bench]')")

from benchmarks import fleet_sim  # noqa: E402
from benchmarks import fleet_sim_models as models  # noqa: E402
from benchmarks.fleet_sim_engine import Fleet, SimConfig  # noqa: E402
from pdserve.bench.traces import TraceRequest  # noqa: E402
from pdserve.router.registry import Registry  # noqa: E402

COEF = (2e-3, 1e-5, 1e-4, 1e-7)  # 2 ms a step, 10 us a prefill token, 0.1 ms a sequence, 0.1 us a context token


def fitted_model(num_blocks=10_000):
    return models.FittedModel("test", 1000.0, num_blocks, coef=COEF)


def run(trace, p, d, **cfg):
    fleet = Fleet(fitted_model(cfg.pop("num_blocks", 10_000)), p, d, SimConfig(**cfg))
    fleet.run(trace)
    return fleet


def sparse_trace(n=5, gap=2.0, lin=300, lout=20):
    return [TraceRequest(i * gap, lin, lout) for i in range(n)]


def test_single_node_low_load_matches_the_model():
    fleet = run(sparse_trace(lin=300, lout=20), 0, 1, policy="never", chunk=512)
    m = fitted_model()
    prefill_s = m.step_time(300, 0, 0)
    for r in fleet.requests:
        assert r.ttft == pytest.approx(prefill_s, rel=1e-6)
        # decode steps: one sequence, context growing from 301 to 319 tokens
        steps = [m.step_time(0, 1, 301 + i) for i in range(19)]
        assert r.tpot == pytest.approx(sum(steps) / 19, rel=1e-6)


def test_remote_prefill_ttft_before_the_handoff():
    fleet = run(sparse_trace(lin=1000, lout=10), 1, 1, policy="always", chunk=512, interconnect_Bps=1e6)
    m = fitted_model()
    prefill_s = m.step_time(512, 0, 0) + m.step_time(488, 0, 0)
    handoff = 1000 * 1000.0 / 1e6  # 1 s
    for r in fleet.requests:
        assert r.ttft == pytest.approx(prefill_s, rel=1e-6)
        assert r.finish - r.first_token > handoff  # the second token waits for the KV


def _assert_conserved(fleet):
    assert all(r.finish is not None for r in fleet.requests)
    assert fleet.done == len(fleet.requests)
    for node in fleet.nodes.values():
        assert node.held() == 0 and node.used_blocks == 0, node.node_id
    for info in fleet.registry.nodes.values():
        assert not info.request_ids and not info.outstanding_prompt_tokens, info.node_id


@pytest.mark.parametrize("policy,p", [("always", 2), ("never", 0), ("auto", 2)])
def test_conservation(policy, p):
    trace = fleet_sim.poisson_trace(40, 10, 500, 50, range_ratio=0.5, seed=1)
    fleet = run(trace, p, 3, policy=policy, max_num_seqs=8, num_blocks=200)  # batch and KV limits bite
    _assert_conserved(fleet)
    assert isinstance(fleet.registry, Registry)


def test_policy_never_sends_nothing_to_prefill_nodes():
    trace = fleet_sim.poisson_trace(20, 5, 300, 20, seed=2)
    fleet = run(trace, 2, 2, policy="never")
    prefill_ids = {n.node_id for n in fleet.nodes.values() if n.role == "prefill"}
    assert all(r.local and not set(r.route_ids) & prefill_ids for r in fleet.requests)
    assert all(n.num_steps == 0 for n in fleet.nodes.values() if n.role == "prefill")
    _assert_conserved(fleet)


def test_planner_role_changes_reach_the_registry():
    # Colocated start (every node prefills and decodes, so the planner knows their speed), then a
    # prefill-heavy load with a tight TPOT SLO: the planner should move nodes to prefill.
    trace = fleet_sim.poisson_trace(60, 40, 2000, 20, seed=3)
    fleet = Fleet(fitted_model(), 0, 4, SimConfig(policy="auto", planner=True, planner_interval_s=2.0,
                                                  planner_window_s=10.0, planner_cooldown_s=4.0,
                                                  slo_ttft_s=0.5, slo_tpot_s=0.004, switch_delay_s=0.5))
    fleet.run(trace)
    assert fleet.decisions, "the planner was never called"
    assert fleet.role_changes, [d["reason"] for d in fleet.decisions[-3:]]
    t, node_id, old, new = fleet.role_changes[0]
    assert (old, new) == ("decode", "prefill")
    roles = {nid: info.role for nid, info in fleet.registry.nodes.items()}
    assert roles == {nid: n.role for nid, n in fleet.nodes.items()}
    assert any(r == "prefill" for r in roles.values())
    _assert_conserved(fleet)


def test_roofline_one_step_by_hand():
    m = models.roofline("h200", "llama-3.1-8b")
    # decode: 64 sequences, 64k context tokens: memory bound
    kv = 2 * 32 * 8 * 128 * 2
    assert kv == 131072 == m.kv_bytes_per_token
    nbytes = 2 * 8.03e9 + kv * 65536
    flops = 2 * 8.03e9 * 64 + 4 * 32 * 4096 * 65536
    want = max(nbytes / (4.8e12 * 0.8), flops / (989e12 * 0.6)) + 1e-3
    assert float(m.step_time(0, 64, 65536)) == pytest.approx(want, rel=1e-9)
    assert want == pytest.approx(nbytes / 3.84e12 + 1e-3)
    # prefill: a 512-token chunk: compute bound
    flops = 2 * 8.03e9 * 512 + 4 * 32 * 4096 * 512 ** 2 / 2
    assert float(m.step_time(512, 0, 0)) == pytest.approx(flops / (989e12 * 0.6) + 1e-3, rel=1e-9)
    # 70B on 4 x H100: a quarter of the weights per GPU, plus the all-reduces
    m70 = models.roofline("h100", "llama-3.1-70b", 4)
    want = (2 * 70.6e9 / 4) / (3.35e12 * 0.8) + 1e-3 + 2 * 80 * 10e-6
    assert float(m70.step_time(0, 1, 0)) == pytest.approx(want, rel=1e-3)
    assert m70.num_blocks == int((80e9 * 4 * 0.9 - 2 * 70.6e9) // (327680 * 16))


def test_fit_subcommand_uses_stepmodel(tmp_path, capsys):
    samples = [[p, b, c, COEF[0] + COEF[1] * p + COEF[2] * b + COEF[3] * c]
               for p, b, c in [(512, 0, 0), (256, 4, 800), (0, 8, 4000), (0, 16, 9000), (128, 2, 100),
                               (0, 32, 20000), (384, 0, 0), (0, 1, 50)] * 3]
    src = tmp_path / "samples.json"
    src.write_text(json.dumps(samples))
    out = tmp_path / "fit.json"
    assert fleet_sim.main(["fit", str(src), "--out", str(out)]) == 0
    coef = json.loads(out.read_text())["coef"]
    m = models.fitted(out, kv_bytes_per_token_=1.0, num_blocks=10)
    assert m.step_time(512, 0, 0) == pytest.approx(COEF[0] + COEF[1] * 512, rel=0.05)
    assert len(coef) == 4


def test_cli_run_and_bad_flags(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert fleet_sim.main(["run", "--nodes", "2", "--prefill", "1", "--rate", "2", "--duration-s", "5",
                           "--out", str(out), "--quiet"]) == 0
    data = json.loads(out.read_text())
    assert data["run"]["finished"] == data["run"]["requests"] > 0
    for bad in (["run", "--rate", "0"], ["run", "--node-model", "fitted"], ["run", "--gpu", "a100"],
                ["run", "--nodes", "2", "--prefill", "2"], ["run", "--workload", "azure"], ["validate"]):
        with pytest.raises(SystemExit):
            fleet_sim.main(bad + ["--out", str(tmp_path / "x.json")])


def test_goodput_search_and_validate(tmp_path):
    args = fleet_sim.build_parser().parse_args(
        ["run", "--node-model", "roofline", "--nodes", "2", "--duration-s", "10", "--input-len", "1000",
         "--output-len", "50", "--search-min-rate", "4", "--search-max-rate", "64", "--search-iters", "2"])
    model = fleet_sim.node_model(args)
    res = fleet_sim.goodput(args, model, (1, 1), policy="always", planner=False)
    assert res["goodput"] > 0 and res["probes"]
    measured = [{"workload": {"input_len": 1000, "output_len": 50}, "split": [1, 1], "load": 2.0, "duration_s": 10,
                 "ttft_p50": 0.03, "ttft_p90": 0.035, "tpot_p50": 0.0053, "tpot_p90": 0.006}]
    f = tmp_path / "measured.json"
    f.write_text(json.dumps(measured))
    rows = fleet_sim.validate(args, model, f)["runs"]
    assert math.isfinite(rows[0]["ttft_p50"]["rel_err"])


def test_azure_replay_through_bench_traces(tmp_path):
    from pdserve.bench.traces import write_azure_trace

    src = tmp_path / "trace.csv"
    write_azure_trace(src, [TraceRequest(i * 0.5, 100 + i, 5) for i in range(10)])  # 2 req/s native
    args = fleet_sim.build_parser().parse_args(["run", "--workload", "azure", "--trace", str(src)])
    trace = fleet_sim.make_trace(args, 4.0)  # replayed twice as fast
    assert len(trace) == 10 and trace[-1].arrival_s == pytest.approx(10 / 4.0, rel=1e-3)  # n / span = the rate
    _assert_conserved(run(trace, 1, 1, policy="always"))
