"""Tensor parallelism served for real: `pdserve serve` with a different --tensor-parallel-size on
the prefill and decode pools. Every output equals transformers' greedy one; each decode rank
receives exactly its KV heads' share of the bytes (read from the node's /metrics); nothing is left
in use at the end; a rank killed mid-stream fails its node as a whole, every stream still
completes exactly (re-dispatch), and `pdserve serve` restarts the node, which serves again."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest

from benchmarks.harness.stack import Stack
from pdserve.bench.chaos import retries_in
from tests.e2e.conftest import hf_greedy, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
SMALL_POOL = ["--kv-cache-memory-gb", "0.05"]
MAX_TOKENS = 8
LONG = 96  # the dead-rank test's streams: long enough to be cut mid-way
TP = "--tensor-parallel-size {}"
NUM_KV_HEADS = 2  # tests/conftest.py's tiny model
RANK_BYTES = "pdserve_kv_bytes_received_by_rank_total"


def tp(size: int) -> str:
    return TP.format(size)


def completions(stack: Stack, prompt_list: list[list[int]]) -> list[list[int]]:
    """One streamed completion per prompt, all at once (a thread each); their token ids."""
    results: list[list[int] | BaseException] = [[] for _ in prompt_list]

    def run(i: int, prompt: list[int]) -> None:
        try:
            for _, event in stack.stream("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                             "temperature": 0, "return_token_ids": True}):
                for choice in event["choices"]:
                    results[i] += choice.get("token_ids", [])
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i, p), daemon=True) for i, p in enumerate(prompt_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    return results


def metric_values(url: str, name: str) -> dict[str, float]:
    """{labels text: value} of every sample of `name` on a /metrics page."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line[len(name):].rpartition(" ")
            out[labels] = float(value)
    return out


def decode_nodes(stack: Stack) -> list[dict]:
    return [n for n in stack.nodes() if n["role"] == "decode"]


def wait_ready_nodes(stack: Stack, count: int, timeout: float = 120.0) -> None:
    """Until `count` nodes are registered and ready: the stack is "ready" as soon as one node of
    each role is, and a TP node (its ranks to start) can come up later than the others."""
    deadline = time.monotonic() + timeout
    while sum(1 for n in stack.nodes() if n.get("ready")) < count:
        assert time.monotonic() < deadline, stack.nodes()
        time.sleep(0.5)


def assert_idle(stack: Stack) -> None:
    for status in stack.wait_idle():
        assert status["num_used_blocks"] == 0, status
        assert status["num_running"] == 0 and status["num_waiting"] == 0, status
        assert status.get("num_leases", 0) == 0 and status.get("num_receiving", 0) == 0, status


def assert_rank_shares(stack: Stack) -> None:
    """Each decode rank received exactly its heads' share of its node's KV bytes: with H KV heads
    over N ranks, rank r holds max(1, H/N) heads (one replicated head when N > H)."""
    for node in decode_nodes(stack):
        per_rank = metric_values(node["status_url"], RANK_BYTES)
        assert per_rank and sum(per_rank.values()) > 0, f"no {RANK_BYTES} on {node['node_id']}: {per_rank}"
        size = len(per_rank)
        heads = max(1, NUM_KV_HEADS // size)
        total_heads = heads * size
        total = sum(per_rank.values())
        for labels, value in per_rank.items():
            assert value * total_heads == total * heads, (node["node_id"], labels, per_rank)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_tp_pairs_equal_transformers(model_dir, prefill_tp, decode_tp):
    _, model, _ = model_dir
    stack = Stack(str(model_dir[0]), prefill_args=tp(prefill_tp), decode_args=tp(decode_tp), extra=SMALL_POOL)
    try:
        wait_ready_nodes(stack, 2)
        ps = prompts(6, seed=prefill_tp * 10 + decode_tp)
        assert completions(stack, ps) == [hf_greedy(model, p, MAX_TOKENS) for p in ps]
        assert_idle(stack)
        assert_rank_shares(stack)
    finally:
        stack.close()


def test_mixed_tp_pools_32_streams(model_dir):
    """2 prefill nodes (TP 2 and TP 1) + 2 decode nodes (TP 1 and TP 2): 32 concurrent streams."""
    _, model, _ = model_dir
    stack = Stack(str(model_dir[0]), num_prefill=2, num_decode=2, prefill_args=[tp(2), tp(1)],
                  decode_args=[tp(1), tp(2)], extra=SMALL_POOL)
    try:
        wait_ready_nodes(stack, 4)
        ps = prompts(32, seed=5)
        assert completions(stack, ps) == [hf_greedy(model, p, MAX_TOKENS) for p in ps]
        assert_idle(stack)
        assert_rank_shares(stack)
        served = {n["node_id"]: n for n in stack.nodes()}
        assert len(served) == 4
    finally:
        stack.close()


def worker_pids(node_pid: int) -> list[int]:
    """The tensor-parallel worker processes (ranks > 0) a node process started."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (OSError, ValueError, IndexError):
            continue
        if ppid == node_pid and b"pdserve.engine.parallel.worker" in cmdline:
            pids.append(int(entry))
    return pids


def test_dead_rank_redispatches_and_node_restarts(model_dir):
    """Kill decode rank 1 mid-stream: its node fails as a whole (no hang), every stream completes
    identically through the other decode node, `pdserve serve` restarts the node and it serves again."""
    _, model, _ = model_dir
    stack = Stack(str(model_dir[0]), num_decode=2, decode_args=[tp(2), tp(1)], extra=SMALL_POOL)
    try:
        wait_ready_nodes(stack, 3)
        victim = next(n for n in stack.node_status() if n["node_id"] == "decode-0")
        workers = worker_pids(victim["pid"])
        assert len(workers) == 1, workers
        ps = prompts(16, seed=9, lo=20, hi=120)
        want = [hf_greedy(model, p, LONG) for p in ps]
        results: list = [None] * len(ps)
        partial: list[list[int]] = [[] for _ in ps]

        def run(i: int) -> None:
            try:
                for _, event in stack.stream("/v1/completions", {"prompt": ps[i], "max_tokens": LONG, "temperature": 0,
                                                                 "return_token_ids": True}):
                    for choice in event["choices"]:
                        partial[i] += choice.get("token_ids", [])
                results[i] = partial[i]
            except BaseException as e:  # noqa: BLE001
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(ps))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sum(1 for p in partial if p) < len(ps) // 2:  # streams under way: some on decode-0
            assert time.monotonic() < deadline, "streams did not start"
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGKILL)
        unfinished = sum(1 for r in results if r is None)
        for t in threads:
            t.join(240)
        assert unfinished > 0  # the kill came mid-stream
        assert results == want
        with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as r:
            assert retries_in(r.read().decode()) > 0  # decode-0's requests were re-dispatched

        def restarted() -> bool:
            try:
                status = next((n for n in stack.node_status() if n["node_id"] == "decode-0"), None)
            except OSError:
                return False
            return status is not None and status["pid"] != victim["pid"] and len(worker_pids(status["pid"])) == 1

        deadline = time.monotonic() + 120
        while not restarted():
            assert time.monotonic() < deadline, "decode-0 was not restarted with its rank"
            time.sleep(0.5)
        assert not os.path.exists(f"/proc/{victim['pid']}")  # the failed node exited (no hang), reaped
        more = prompts(8, seed=11)
        assert completions(stack, more) == [hf_greedy(model, p, MAX_TOKENS) for p in more]
        assert_idle(stack)
    finally:
        stack.close()
