"""Redispatcher alone, on a registry and a request table, with a fake dispatcher: which requests a
lost node takes with it, the next attempt, parking, and giving up."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.metrics import RouterMetrics
from pdserve.router.redispatch import Redispatcher
from pdserve.router.registry import Registry
from pdserve.router.request_state import RouterRequestStatus
from pdserve.router.request_table import RequestTable
from tests.router.fakes import FakeDispatcher, add_node, make_request

pytestmark = pytest.mark.timeout(30)


class Parts:
    def __init__(self, *, max_retries: int = 3, retry_wait_s: float = 30.0) -> None:
        self.registry = Registry()
        self.table = RequestTable(self.registry)
        self.dispatcher = FakeDispatcher(self.table, self.registry)
        self.metrics = RouterMetrics()
        self.redispatcher = Redispatcher(self.table, self.dispatcher, self.metrics, max_retries=max_retries,
                                         retry_wait_s=retry_wait_s)

    def in_flight(self, tokenizer, request_id: str):
        req = make_request(tokenizer, request_id)
        asyncio.run(self.redispatcher.start(req, self.dispatcher.reroute(req)))
        return req


def test_a_lost_node_takes_the_attempts_that_need_it(tokenizer):
    parts = Parts()
    for node_id, role in (("p0", "prefill"), ("d0", "decode")):
        add_node(parts.registry, node_id, role)
    prefilling = parts.in_flight(tokenizer, "a")
    decoding = parts.in_flight(tokenizer, "b")
    decoding.output_token_ids.append(7)  # its first token is out: p0 is no longer needed
    assert prefilling.node_ids == decoding.node_ids == ["p0", "d0"]
    lost = parts.registry.remove("p0")
    add_node(parts.registry, "p1", "prefill")
    asyncio.run(parts.redispatcher.node_lost(lost, "node p0 stopped responding"))
    assert [c[1] for c in parts.dispatcher.named("dispatch")] == ["a", "b", "a~1"]
    assert prefilling.attempt == 1 and decoding.attempt == 0
    assert parts.metrics.retries._value.get() == 1


def test_redispatch_forgets_the_attempt_aborts_it_and_starts_the_next(tokenizer):
    parts = Parts()
    add_node(parts.registry, "b0", "both")
    req = parts.in_flight(tokenizer, "a")
    asyncio.run(parts.redispatcher.redispatch(req, "KV transfer failed"))
    assert parts.dispatcher.calls[1:] == [("abort_nodes", "a", ["b0"]), ("dispatch", "a~1", ["b0"])]
    assert parts.table.attempt("a") is None and parts.table.attempt("a~1") is req
    assert parts.registry.nodes["b0"].request_ids == {"a~1"}
    parts.table.check_invariants()


def test_an_unreachable_prefill_node_is_retried_until_max_retries_then_the_request_fails(tokenizer):
    parts = Parts(max_retries=2)
    add_node(parts.registry, "b0", "both")
    parts.dispatcher.reachable = False
    req = parts.in_flight(tokenizer, "a")
    assert [c[1] for c in parts.dispatcher.named("dispatch")] == ["a", "a~1", "a~2"]
    assert parts.dispatcher.named("fail") == [("fail", "a", 503)]
    assert req.status == RouterRequestStatus.FAILED and len(parts.table) == 0


def test_with_no_node_the_request_parks_and_a_ready_node_takes_it(tokenizer):
    parts = Parts()
    add_node(parts.registry, "b0", "both")
    req = parts.in_flight(tokenizer, "a")
    parts.dispatcher.no_node = "decode"
    asyncio.run(parts.redispatcher.redispatch(req, "node b0 left"))
    parked = parts.table.parked["a"]
    assert parked.reason == "node b0 left; no ready decode node to retry on" and parked.req is req
    assert parts.table.attempt("a~1") is None and len(parts.table) == 1
    asyncio.run(parts.redispatcher.unpark())  # still no node: it waits
    assert "a" in parts.table.parked
    parts.dispatcher.no_node = None
    asyncio.run(parts.redispatcher.unpark())
    assert not parts.table.parked and parts.table.attempt("a~1") is req
    parts.table.check_invariants()


def test_a_parked_request_fails_past_its_wait_or_at_once_without_one(tokenizer):
    parts = Parts()
    add_node(parts.registry, "b0", "both")
    req = parts.in_flight(tokenizer, "a")
    parts.dispatcher.no_node = "prefill"
    asyncio.run(parts.redispatcher.redispatch(req, "gone"))
    parts.table.parked["a"].wait_until = time.monotonic() - 1
    asyncio.run(parts.redispatcher.unpark())
    assert parts.dispatcher.named("fail") == [("fail", "a", 503)] and len(parts.table) == 0

    impatient = Parts(retry_wait_s=0)
    add_node(impatient.registry, "b0", "both")
    req = impatient.in_flight(tokenizer, "b")
    impatient.dispatcher.no_node = "prefill"
    asyncio.run(impatient.redispatcher.redispatch(req, "gone"))
    assert impatient.dispatcher.named("fail") == [("fail", "b", 503)] and not impatient.table.parked


def test_a_parked_request_that_ended_meanwhile_just_leaves(tokenizer):
    parts = Parts()
    add_node(parts.registry, "b0", "both")
    req = parts.in_flight(tokenizer, "a")
    parts.dispatcher.no_node = "prefill"
    asyncio.run(parts.redispatcher.redispatch(req, "gone"))
    req.abort()
    asyncio.run(parts.redispatcher.unpark())
    assert not parts.table.parked and len(parts.table) == 0
    assert len(parts.dispatcher.named("dispatch")) == 1
