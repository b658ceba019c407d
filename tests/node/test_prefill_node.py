"""The prefill node's request table against its engine and its KV sender: a hand-off that fails
reports to the request's own router before the request is forgotten, aborts forget every stage,
and the table always lists what the engine and the sender hold (tiny model, real KVSender)."""

from __future__ import annotations

import pytest

from pdserve.node.requests import Stage
from pdserve.protocol.messages import Abort, Error, FirstToken, PrefillRequest
from tests.kvtransfer.test_node_metrics import make_engine
from tests.node.test_router_links import FakeRouter, make_links, poll_until

GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def node(tiny_llama):
    from pdserve.kvtransfer.sender import KVSender
    from pdserve.node.engine_wire import kv_layout
    from pdserve.prefill_node.node import PrefillNode

    routers = [FakeRouter(), FakeRouter()]
    links = make_links([r.addr for r in routers])
    engine = make_engine(tiny_llama)
    node = PrefillNode(engine, links, make_sender=lambda release, on_error: KVSender(
        "p0", kv_layout(engine, "tiny"), engine.runner.kv_buffer, release, on_error=on_error))
    links.register()
    yield node, routers
    node.sender.close()
    links.close()
    for r in routers:
        r.close()


def held_elsewhere(node) -> list[str]:
    """What the engine and the sender hold: the table must list exactly these."""
    return sorted([*node.engine.scheduler.requests, *node.sender.held_request_ids])


def test_a_refused_hand_off_reports_to_its_own_router_then_is_forgotten(node, no_leak):
    node, (a, b) = node
    assert node.requests is node.link.requests  # one table: the links note origins in it
    a.send(PrefillRequest("r1", list(range(3, 30)), GREEDY, "d0", "tcp://10.9.9.9:5"))  # beyond loopback, no keys
    for msg in poll_until(node.link, 1):
        node.handle(msg)
    assert node.requests.stage("r1") is Stage.PREFILLING and node.requests.origin("r1") == a.addr
    while not node.is_idle():
        node.run_once()
        assert sorted(node.requests.held_ids()) == held_elsewhere(node)
    assert a.wait_for(FirstToken, Error)
    errors_a = [m for m in a.recv_all() if isinstance(m, Error)]
    assert [e.request_id for e in errors_a] == ["r1"] and errors_a[0].retryable
    assert not any(isinstance(m, (Error, FirstToken)) for m in b.recv_all())  # only its router hears of it
    assert len(node.requests) == 0 and node.requests.recent[-1]["request_id"] == "r1"
    assert "kv_released" in node.requests.recent[-1]
    no_leak(node.engine.block_manager)


def test_aborts_forget_a_request_at_every_stage(node, no_leak):
    node, (a, b) = node
    node.handle(PrefillRequest("queued", list(range(3, 30)), GREEDY, "d0", "tcp://127.0.0.1:1"))
    node.handle(PrefillRequest("handed", list(range(3, 30)), GREEDY, "d0", "tcp://127.0.0.1:1"))
    assert node.requests.held_ids() == ["queued", "handed"]
    node.abort("queued")
    while node.requests.stage("handed") is not Stage.HANDED_OFF:
        node.run_once()
    assert node.sender.held_request_ids == ["handed"] and node.requests.num(Stage.HANDED_OFF) == 1
    assert node.heartbeat().request_ids == ["handed"] and node.status()["num_leases"] == 1
    node.handle(Abort("handed"))  # its lease released: blocks freed, forgotten
    assert len(node.requests) == 0 and node.sender.num_held == 0 and node.is_idle()
    no_leak(node.engine.block_manager)


def test_a_refused_request_leaves_nothing_behind(node):
    node, (a, b) = node
    a.send(PrefillRequest("bad", [10_000], GREEDY))  # a token id outside the vocabulary
    for msg in poll_until(node.link, 1):
        node.handle(msg)
    assert a.wait_for(Error) and len(node.requests) == 0 and node.link.origin("bad") == ""
