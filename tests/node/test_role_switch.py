"""A node process changing role on a router's SetRole (node/role_switch.py, composed by
cli/node.py): it stops taking requests, finishes what it holds (a prefill node its queue and
hand-offs, a decode node its running requests), then serves the other role around the same
engine, links, table and metrics, registered again; both directions, and the timeout that gives
the rest back to the router. Tiny model, in process, real KV sender and receivers over ZMQ."""

from __future__ import annotations

import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.protocol.messages import (
    Deregister,
    Error,
    FirstToken,
    Heartbeat,
    PrefillRequest,
    Register,
    SetRole,
    TokenBatch,
    decode,
)
from tests.conftest import assert_no_leak
from tests.kvtransfer.test_node_metrics import make_engine, samples, value
from tests.node.test_router_links import FakeRouter, make_links

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


class Stack:
    """The switching node `n0` (links to `router`) and a plain decode node `d1` it hands off to
    while it serves prefill (its tokens to `peer_router`)."""

    def __init__(self, model_dir, role: str, *, timeout_s: float = 60.0) -> None:
        from pdserve.cli.node import compose
        from pdserve.decode_node.node import DecodeNode
        from pdserve.kvtransfer.receiver import KVReceiver
        from pdserve.kvtransfer.sender import KVSender
        from pdserve.node.engine_wire import kv_layout, register_message
        from pdserve.node.router_link import RouterLink

        self.router, self.peer_router = FakeRouter(), FakeRouter()
        self.links = make_links([self.router.addr])
        self.engine = make_engine(model_dir)
        self.receiver = KVReceiver("n0", kv_layout(self.engine, "tiny"), self.engine.runner.kv_buffer)
        self.node = compose(self.engine, self.links, self.receiver, lambda release, on_error: KVSender(
            "n0", kv_layout(self.engine, "tiny"), self.engine.runner.kv_buffer, release, on_error=on_error),
            role=role, kv_addr=self.receiver.kv_addr, timeout_s=timeout_s)
        de = make_engine(model_dir)
        self.peer_receiver = KVReceiver("d1", kv_layout(de, "tiny"), de.runner.kv_buffer)
        self.peer = DecodeNode(de, RouterLink(self.peer_router.addr, register_message("d1", "decode", de, "tiny")),
                               self.peer_receiver)
        self.peer.link.register()
        self.links.register()
        assert self.router.wait_for(Register) and self.peer_router.wait_for(Register)

    def run(self, until, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not until():
            self.node.run_once()
            self.peer.run_once()
            for r in (self.router, self.peer_router):
                while r.sock.poll(0):
                    r.received.append(decode(r.sock.recv_multipart()[1]))
            assert time.monotonic() < deadline, "not done in time"

    def settle(self) -> None:
        self.run(lambda: self.node.is_idle() and self.peer.is_idle())
        self.router.recv_all(0.3)
        self.peer_router.recv_all(0.3)

    def tokens(self, rid: str) -> list[int]:
        out = {}
        for m in [*self.router.received, *self.peer_router.received]:
            if isinstance(m, FirstToken) and m.request_id == rid:
                out[0] = m.token_id
            elif isinstance(m, TokenBatch):
                out.update({t.index: t.token_id for t in m.tokens() if t.request_id == rid})
        return [out[i] for i in range(len(out))]

    def errors(self) -> dict[str, Error]:
        return {m.request_id: m for m in self.router.received if isinstance(m, Error)}

    def registers(self) -> list[Register]:
        return [m for m in self.router.received if isinstance(m, Register)]

    def close(self) -> None:
        for closer in (self.node.sender, self.receiver, self.peer_receiver, self.links, self.peer.link):
            closer.close()
        self.router.close()
        self.peer_router.close()


@pytest.fixture
def reference(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", num_threads=1, kv_cache_memory_gb=0.01)

    def greedy(prompt, max_tokens=GREEDY["max_tokens"]):
        return llm.generate([prompt], SamplingParams(**{**GREEDY, "max_tokens": max_tokens}), use_tqdm=False)[0].token_ids
    return greedy


def role_metrics(stack) -> tuple[dict, dict]:
    s = samples(stack.node.metrics.render())
    roles = {r: value(s, "pdserve_node_role", node_id="n0", role=r) for r in ("prefill", "decode")}
    return s, roles


def test_prefill_to_decode_and_back_finishes_everything_first(tiny_llama, reference):
    stack = Stack(tiny_llama, "prefill")
    node, router = stack.node, stack.router
    p1, p2, p3 = list(range(5, 45)), list(range(9, 30)), list(range(11, 60))
    try:
        baseline = stack.engine.block_manager.num_free_blocks
        sender = node.node.sender
        router.send(PrefillRequest("h1", p1, GREEDY, "d1", stack.peer_receiver.kv_addr))
        stack.run(lambda: "h1" in node.requests.held_ids())
        router.send(SetRole("decode", "test"))
        stack.run(lambda: node.target == "decode" or node.role == "decode")
        assert node.heartbeat().ready is False or node.role == "decode"
        router.send(PrefillRequest("late", p2, GREEDY, "d1", stack.peer_receiver.kv_addr))
        stack.run(lambda: node.role == "decode")
        # The hand-off finished on the peer (the lease released by its KVDone) before the switch.
        assert stack.peer.requests.recent and sender.num_held == 0
        stack.settle()
        assert stack.tokens("h1") == reference(p1)
        assert stack.errors()["late"].retryable  # refused while switching: the router sends it elsewhere
        register = stack.registers()[-1]
        assert (register.role, register.kv_addr, register.node_id) == ("decode", stack.receiver.kv_addr, "n0")
        assert node.status()["role"] == "decode" and node.heartbeat().role == "decode" and node.heartbeat().ready
        assert stack.engine.block_manager.num_free_blocks == baseline
        s, roles = role_metrics(stack)
        assert roles == {"prefill": 0, "decode": 1}
        assert value(s, "pdserve_node_role_changes_total", node_id="n0", from_role="prefill", to_role="decode") == 1

        # As a decode node: a local prefill; then back to prefill while it still decodes.
        router.send(PrefillRequest("l1", p3, {**GREEDY, "max_tokens": 30}))
        stack.run(lambda: "l1" in node.requests.held_ids())
        router.send(SetRole("prefill", "back"))
        stack.run(lambda: node.role == "prefill")
        stack.settle()
        assert stack.tokens("l1") == reference(p3, 30)  # finished, not dropped, before the switch
        assert stack.registers()[-1].role == "prefill" and stack.registers()[-1].kv_addr == ""
        # The same KV sender again, its callbacks now this prefill node's: a hand-off works.
        assert node.node.sender is sender
        router.send(PrefillRequest("h2", p2, GREEDY, "d1", stack.peer_receiver.kv_addr))
        stack.run(lambda: "h2" in node.requests.held_ids())
        stack.settle()
        assert stack.tokens("h2") == reference(p2) and sender.num_held == 0
        s, roles = role_metrics(stack)
        assert roles == {"prefill": 1, "decode": 0} and node.num_changes == 2
        assert value(s, "pdserve_node_role_changes_total", node_id="n0", from_role="decode", to_role="prefill") == 1
        assert not [e for rid, e in stack.errors().items() if rid != "late"]
    finally:
        stack.close()
    assert_no_leak(stack.engine.block_manager)
    assert_no_leak(stack.peer.engine.block_manager)


def test_set_role_that_changes_nothing_is_ignored_or_called_off(tiny_llama):
    stack = Stack(tiny_llama, "decode")
    node = stack.node
    try:
        for msg in (SetRole("decode"), SetRole("both"), SetRole("router")):
            node.node.handle(msg)
            assert node.target is None and node.role == "decode" and node.heartbeat().ready
        node.node.handle(PrefillRequest("l1", list(range(5, 30)), {**GREEDY, "max_tokens": 40}))
        node.run_once()
        node.node.handle(SetRole("prefill"))
        assert node.target == "prefill" and not node.heartbeat().ready
        node.run_once()
        node.node.handle(SetRole("decode", "changed my mind"))  # called off: ready again
        assert node.target is None and node.heartbeat().ready
        stack.settle()
        assert node.role == "decode" and node.num_changes == 0 and len(stack.tokens("l1")) == 40
        assert len(stack.registers()) == 1
    finally:
        stack.close()
    assert_no_leak(stack.engine.block_manager)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_role_change_that_times_out_gives_the_rest_back(tiny_llama, role):
    stack = Stack(tiny_llama, role, timeout_s=0.5)
    node, router = stack.node, stack.router
    target = "prefill" if role == "decode" else "decode"
    try:
        sender = node.node.sender if role == "prefill" else None
        if role == "decode":  # a long local request
            router.send(PrefillRequest("long", list(range(5, 30)), {**GREEDY, "max_tokens": 900}))
            stack.run(lambda: "long" in node.requests.held_ids())
        else:  # handed off to a decode node that never answers: its lease would hold for 30 s
            router.send(PrefillRequest("long", list(range(5, 30)), GREEDY, "gone", "tcp://127.0.0.1:9"))
            stack.run(lambda: sender.num_held == 1)
        router.send(SetRole(target, "test"))
        stack.run(lambda: node.role == target, timeout_s=30)
        router.recv_all(0.3)
        assert node.is_idle() and not stack.engine.has_unfinished()
        if role == "decode":  # the router re-dispatches it with the tokens streamed so far
            error = stack.errors()["long"]
            assert error.retryable and "changing role" in error.message
            assert 0 < len(stack.tokens("long")) < 900
        else:  # its lease released at once (the decode node's failed pull reports it to the router)
            assert sender.num_held == 0 and "long" not in stack.errors()
        assert stack.registers()[-1].role == target
    finally:
        stack.close()
    assert_no_leak(stack.engine.block_manager)


def test_heartbeats_say_not_ready_while_switching(tiny_llama):
    stack = Stack(tiny_llama, "decode", timeout_s=30)
    node, router = stack.node, stack.router
    try:
        router.send(PrefillRequest("l1", list(range(5, 30)), {**GREEDY, "max_tokens": 900}))
        stack.run(lambda: "l1" in node.requests.held_ids())
        router.send(SetRole("prefill"))
        stack.run(lambda: node.target == "prefill")
        start = len(router.received)

        def beats():
            return [m for m in router.received[start:] if isinstance(m, Heartbeat)]
        stack.run(lambda: any(b.request_ids for b in beats()))
        beat = [b for b in beats() if b.request_ids][-1]
        assert not beat.ready and beat.role == "decode" and beat.request_ids == ["l1"]
        stack.run(lambda: node.role == "prefill")
        node.link.set_heartbeat(node.heartbeat())
        start = len(router.received)
        stack.run(lambda: bool(beats()))
        beat = beats()[-1]
        assert beat.ready and beat.role == "prefill"
        stack.settle()
        assert len(stack.tokens("l1")) == 900
    finally:
        stack.close()
    assert_no_leak(stack.engine.block_manager)


def test_serving_prefill_a_kv_ready_that_still_arrives_is_refused(tiny_llama):
    from pdserve.kvtransfer.receiver import KVEvent, KVEventKind
    from pdserve.protocol.messages import KVReady
    from tests.node.test_decode_node import FakeReceiver

    stack = Stack(tiny_llama, "prefill")
    node = stack.node
    real, node.receiver = node.receiver, FakeReceiver()
    try:
        ready = KVReady("stale", list(range(3, 20)), 5, None, GREEDY, 17, [0, 1], 16, 30.0)
        node.receiver.events = [KVEvent(KVEventKind.READY, "stale", ready)]
        node.run_once()
        assert node.receiver.released == [("stale", "n0 serves prefill now, not decode")]
        stack.router.recv_all(0.3)
        assert stack.errors()["stale"].retryable and "stale" not in node.requests
        assert not stack.engine.has_unfinished()
    finally:
        node.receiver = real
        stack.close()


def test_draining_calls_a_pending_change_off(tiny_llama):
    from pdserve.node.runtime import serve_node

    stack = Stack(tiny_llama, "decode")
    node, router = stack.node, stack.router
    try:
        router.send(PrefillRequest("l1", list(range(5, 30)), {**GREEDY, "max_tokens": 50}))
        stack.run(lambda: "l1" in node.requests.held_ids())
        router.send(SetRole("prefill"))
        stack.run(lambda: node.target == "prefill")
        serve_node(node, node.link, stop_flag=[True], drain_timeout_s=30)  # SIGTERM now: drains, then leaves
        assert node.target is None and node.role == "decode" and node.is_idle()
        router.recv_all(0.3)
        assert len(stack.tokens("l1")) == 50  # finished, then deregistered (no Register as prefill)
        assert [r.role for r in stack.registers()] == ["decode", "decode"]  # serve_node registers once more
        assert any(isinstance(m, Deregister) for m in router.received)
    finally:
        stack.close()
    assert_no_leak(stack.engine.block_manager)


def test_a_step_that_raises_after_a_role_change_still_deregisters(tiny_llama, monkeypatch):
    from pdserve.node.runtime import serve_node

    stack = Stack(tiny_llama, "prefill")
    node, router = stack.node, stack.router
    try:
        router.send(SetRole("decode"))
        stack.run(lambda: node.role == "decode")

        def broken():
            raise RuntimeError("a rank died")
        monkeypatch.setattr(stack.engine, "step_requests", broken)
        router.send(PrefillRequest("l1", list(range(5, 30)), GREEDY))
        with pytest.raises(RuntimeError, match="a rank died"):
            serve_node(node, node.link, stop_flag=[False])
        router.recv_all(0.3)
        assert isinstance([m for m in router.received if isinstance(m, (Register, Deregister))][-1], Deregister)
    finally:
        stack.close()
