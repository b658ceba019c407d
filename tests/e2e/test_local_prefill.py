"""A real `pdserve decode` process prefilling locally: a fake router (a ZMQ ROUTER socket speaking
the protocol, in this test) sends it PrefillRequests that name no decode node; the node
prefills them among its running decodes and streams FirstToken, then TokenBatch. Greedy outputs
equal transformers'; its heartbeats carry step samples and its role; SIGTERM still drains it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import zmq

from benchmarks.harness.stack import child_env
from pdserve.engine.request import child_id
from pdserve.protocol.messages import (
    Deregister,
    Error,
    FirstToken,
    Heartbeat,
    PrefillRequest,
    Register,
    TokenBatch,
    decode,
)
from pdserve.protocol.sockets import endpoint, make_socket
from tests.e2e.cluster import ROOT
from tests.e2e.conftest import hf_greedy, prompts

pytestmark = pytest.mark.e2e


class FakeRouter:
    """A bound ROUTER socket: records what every node sent (by node id), sends to a node by id."""

    def __init__(self) -> None:
        self.sock = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0")
        self.addr = endpoint(self.sock)
        self.received: list[tuple[str, object]] = []  # (node id, message), heartbeats included

    def pump(self, wait_s: float = 0.05) -> None:
        deadline = time.monotonic() + wait_s
        while True:
            if self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                identity, frame = self.sock.recv_multipart()
                node = identity.decode().split("#", 1)[0]  # a heartbeat socket's identity: "{node}#heartbeat"
                self.received.append((node, decode(frame)))
            elif time.monotonic() >= deadline:
                return

    def wait(self, predicate, timeout_s: float = 120.0, what: str = "the nodes") -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            self.pump()

    def send(self, node_id: str, msg) -> None:
        self.sock.send_multipart([node_id.encode(), msg.encode()])

    def of(self, node_id: str, kind: type) -> list:
        return [m for n, m in self.received if n == node_id and isinstance(m, kind)]

    def tokens(self, rid: str) -> list[int]:
        out: dict[int, int] = {}
        for _, m in self.received:
            if isinstance(m, FirstToken) and m.request_id == rid:
                out[0] = m.token_id
            elif isinstance(m, TokenBatch):
                out.update({t.index: t.token_id for t in m.tokens() if t.request_id == rid})
        return [out[i] for i in range(len(out))]

    def finished(self, rid: str) -> bool:
        return any(isinstance(m, TokenBatch) and any(t.request_id == rid and t.finish_reason for t in m.tokens())
                   for _, m in self.received) or any(
            isinstance(m, FirstToken) and m.request_id == rid and m.finish_reason for _, m in self.received)

    def close(self) -> None:
        self.sock.close(0)


def spawn_node(command: str, router: FakeRouter, node_id: str, model: str, log_dir, *extra: str) -> subprocess.Popen:
    """`pdserve COMMAND` (the role-changing node) as a process of its own."""
    log = open(log_dir / f"{node_id}.log", "a")
    argv = [sys.executable, "-m", "pdserve.cli.main", command, "--router", router.addr, "--node-id", node_id,
            "--model", model, "--dtype", "float32", "--num-threads", "1", "--log-level", "INFO", *extra]
    proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(OMP_NUM_THREADS="1"), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def get_json(url: str) -> dict:
    import json

    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.timeout(300)
def test_a_decode_node_prefills_locally_exactly(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    path, _, _ = model_dir
    router = FakeRouter()
    proc = spawn_node("decode", router, "d0", str(path), tmp_path, "--max-num-batched-tokens", "64")
    try:
        router.wait(lambda: router.of("d0", Register), what="d0's Register")
        register = router.of("d0", Register)[0]
        assert register.role == "decode" and register.kv_addr.startswith("tcp://") and register.pid == proc.pid
        ps = prompts(4, seed=3, lo=20, hi=150)
        greedy = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        for i, p in enumerate(ps):
            router.send("d0", PrefillRequest(f"r{i}", p, greedy))
        router.send("d0", PrefillRequest("n2", ps[0], {**greedy, "n": 2}))
        router.send("d0", PrefillRequest("meant-for-prefill", ps[1], greedy, "d9", "tcp://127.0.0.1:9"))
        done = [f"r{i}" for i in range(len(ps))] + [child_id("n2", 0), child_id("n2", 1)]
        router.wait(lambda: all(router.finished(rid) for rid in done), what="every request")
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
        for i, p in enumerate(ps):
            assert router.tokens(f"r{i}") == hf_greedy(model, p, 12), i
        assert router.tokens(child_id("n2", 0)) == router.tokens(child_id("n2", 1)) == router.tokens("r0")
        first = {m.request_id: m for m in router.of("d0", FirstToken)}
        assert first["r1"].num_prompt_tokens == len(ps[1])
        (error,) = router.of("d0", Error)
        assert error.request_id == "meant-for-prefill" and error.retryable
        router.wait(lambda: sum(len(hb.step_samples) for hb in router.of("d0", Heartbeat)) > 0)
        beats = router.of("d0", Heartbeat)
        rows = [row for hb in beats for row in hb.step_samples]
        assert all(hb.role == "decode" for hb in beats)
        assert sum(r[0] for r in rows) >= sum(len(p) for p in ps)  # every prompt token computed here
        assert any(r[0] > 0 and r[1] > 0 for r in rows)  # prompt chunks beside running decodes
        status = get_json(register.metrics_url + "/status")
        assert status["role"] == "decode" and status["num_free_blocks"] == status["num_total_blocks"]
    finally:
        code = stop(proc)
        router.pump(0.3)
        router.close()
    assert code == 0 and router.of("d0", Deregister)  # drained, deregistered


# ---- with the real router --------------------------------------------------------------------------
SMALL_POOL = ["--kv-cache-memory-gb", "0.1"]


def completion_ids(stack, prompt, max_tokens: int = 10) -> list[int]:
    status, body = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                  "return_token_ids": True, "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


@pytest.mark.timeout(240)
def test_disagg_policy_never_prefills_on_the_decode_node(model_dir):
    """`pdserve serve --num-prefill 0 --disagg-policy never`: the router sends each request to its
    decode node to prefill there; outputs equal transformers' greedy."""
    from transformers import AutoModelForCausalLM

    from benchmarks.harness.stack import Stack

    path, _, _ = model_dir
    stack = Stack(str(path), num_prefill=0, num_decode=1, extra=[*SMALL_POOL, "--disagg-policy", "never"])
    try:
        (node,) = stack.nodes()
        assert node["role"] == "decode"
        model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
        for p in prompts(3, seed=5, lo=5, hi=120):
            assert completion_ids(stack, p) == hf_greedy(model, p, 10)
        (status,) = stack.wait_idle()
        assert status["role"] == "decode" and status["num_used_blocks"] == 0
        assert [t for t in status["timings"] if "first_token" in t]  # first tokens sampled there
    finally:
        stack.close()
