"""benchmarks/router_capacity.py: core lists, the report of shared cores, and (e2e) 2 real router
processes on one port fed by the fakes, both carrying traffic, all ended afterwards."""

from __future__ import annotations

import argparse
import os
import time

import pytest

from benchmarks import router_capacity as rc


def test_core_lists_parse_and_refuse_what_is_not_one():
    assert rc._cpus("1,0,1") == [0, 1] and rc._cpus("3") == [3]
    for bad in ("", "a", "-1", "0,x"):
        with pytest.raises(argparse.ArgumentTypeError):
            rc._cpus(bad)


def test_core_busy_share_from_two_snapshots():
    assert rc._core_busy({0: (10, 100), 1: (0, 100)}, {0: (60, 200), 1: (100, 200)}) == {0: 0.5, 1: 1.0}
    now = rc._core_times()
    assert set(now) >= set(os.sched_getaffinity(0)) and all(b <= t for b, t in now.values())


def test_table_says_which_cores_each_part_had_and_flags_shared_ones():
    at = {"streams": 64, "client_tok_s": 1000.0, "router_cpu_us_per_token": 5.0, "load_cpu_share": 0.5,
          "load_core_busy": 0.95, "server_generation_tokens": [300, 100],
          "stage_us_per_token": dict.fromkeys(rc.STAGES, 1.0)}
    shared = rc.table({"api_server_count": 2, "cores": {"router": [0, 1], "load": [0, 1], "shared": [0, 1]},
                       "streamed": {"at": at}})
    assert "2 router processes on core(s) 0,1, fakes and client on core(s) 0,1; they SHARE core(s) 0,1" in shared
    assert "95% (saturated: a lower bound)" in shared and "75% / 25%" in shared
    alone = rc.table({"api_server_count": 1, "cores": {"router": [0], "load": [1], "shared": []},
                      "streamed": {"at": {**at, "load_core_busy": 0.5}}})
    assert "1 router process on core(s) 0, fakes and client on core(s) 1\n" in alone
    assert "SHARE" not in alone and "saturated" not in alone and "per router process" not in alone


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_two_router_processes_both_carry_the_fakes_tokens():
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    corpus = rc.corpus_token_ids(AutoTokenizer.from_pretrained(resolve_model(rc.MODEL)))
    cores = sorted(os.sched_getaffinity(0))
    args = argparse.Namespace(api_server_count=2, router_cpu=cores, load_cpu=cores, start_rate=50.0)
    bench = rc.Bench(args, corpus)
    try:
        assert sorted(bench.router_pids) == [0, 1]
        # Each request is a new connection that the kernel hashes to one of the two processes
        # (SO_REUSEPORT): with 24 streams each process's share is nonzero but for ~2^-23 (with 8
        # it was ~1%: a CI run saw [0, 1457]).
        result = bench.probe(24, 20.0, True, 4.0)
        assert result["errors"] == 0 and result["refused_429"] == 0 and result["client_tok_s"] > 0
        assert all(t > 0 for t in result["server_generation_tokens"]), result["server_generation_tokens"]
        assert set(result["core_busy"]) == set(cores)
        assert bench._rss_mb() > 0
    finally:
        bench.close()
    pids = list(bench.router_pids.values())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)  # no router process left behind
