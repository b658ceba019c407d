"""Dispatcher alone, on a registry and a request table, with a fake send and a fake saturation:
admission (429, 503), the PrefillRequest it sends, and the ways a request ends."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import Abort, PrefillRequest, Token
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_errors import ProtocolError
from pdserve.router.openai_protocol import ParsedRequest
from pdserve.router.registry import Registry
from pdserve.router.request_state import RouterError, RouterRequestStatus
from pdserve.router.request_table import RequestTable
from pdserve.router.saturation import RetryAfter
from tests.router.fakes import FakeSend, add_node, make_request

pytestmark = pytest.mark.timeout(30)


class FakeSaturation:
    def __init__(self) -> None:
        self.shed: str | None = None
        self.asked: list[int] = []

    def admit(self, num_in_flight: int) -> str | None:
        self.asked.append(num_in_flight)
        return self.shed


class Parts:
    def __init__(self, max_queue: int = 256, request_timeout_s: float | None = 60.0) -> None:
        self.registry = Registry(max_queue=max_queue)
        self.table = RequestTable(self.registry)
        self.send = FakeSend()
        self.metrics = RouterMetrics()
        self.saturation = FakeSaturation()
        self.dispatcher = Dispatcher(self.registry, self.table, self.send, self.metrics, saturation=self.saturation,
                                     retry_after=RetryAfter(), request_timeout_s=request_timeout_s)

    def value(self, name: str, labels: dict | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def parsed(prompt=(1, 2, 3), max_tokens: int = 8) -> ParsedRequest:
    return ParsedRequest("completion", list(prompt), SamplingParams(max_tokens=max_tokens), False, False, None)


def test_admit_answers_the_deadline_and_the_nodes():
    parts = Parts(request_timeout_s=60.0)
    add_node(parts.registry, "p0", "prefill")
    add_node(parts.registry, "d0", "decode")
    before = time.monotonic()
    deadline, route = parts.dispatcher.admit(parsed())
    assert route.node_ids == ["p0", "d0"] and before + 60 <= deadline <= time.monotonic() + 60
    assert parts.saturation.asked == [0]  # what the router holds, in flight and parked
    untimed = Parts(request_timeout_s=None)
    add_node(untimed.registry, "b0", "both")
    deadline, route = untimed.dispatcher.admit(parsed())
    assert deadline is None and route.node_ids == ["b0"]


def test_admit_refuses_with_503_without_nodes_and_429_when_saturated_or_full():
    parts = Parts(max_queue=1)
    with pytest.raises(ProtocolError) as e:
        parts.dispatcher.admit(parsed())
    assert e.value.status == 503 and "no ready prefill node" in str(e.value)

    add_node(parts.registry, "b0", "both")
    parts.saturation.shed = "loop_lag"
    with pytest.raises(ProtocolError) as e:
        parts.dispatcher.admit(parsed())
    assert e.value.status == 429 and "loop lag" in str(e.value) and int(e.value.headers["Retry-After"]) >= 1
    assert parts.value("pdserve_router_requests_shed_total", {"reason": "loop_lag"}) == 1

    parts.saturation.shed = None
    _, route = parts.dispatcher.admit(parsed())
    parts.registry.add_request(route, "x", 3, 8)  # one waiting for its first token: the queue is full
    with pytest.raises(ProtocolError) as e:
        parts.dispatcher.admit(parsed())
    assert e.value.status == 429 and "queue limit" in str(e.value)


def test_dispatch_sends_the_current_attempt_and_enters_it_in_the_table(tokenizer):
    parts = Parts()
    add_node(parts.registry, "p0", "prefill")
    add_node(parts.registry, "d0", "decode")
    req = make_request(tokenizer, "a")
    assert asyncio.run(parts.dispatcher.dispatch(req, parts.dispatcher.reroute(req)))
    (node_id, msg), = parts.send.sent
    assert node_id == "p0" and isinstance(msg, PrefillRequest)
    assert (msg.request_id, msg.prompt_token_ids, msg.decode_node_id, msg.decode_kv_addr) == ("a", [1, 2, 3], "d0",
                                                                                            "tcp://d0")
    assert parts.table.attempt("a") is req
    parts.send.reachable = False
    other = make_request(tokenizer, "b")
    assert not asyncio.run(parts.dispatcher.dispatch(other, parts.dispatcher.reroute(other)))
    assert parts.table.attempt("b") is other  # in flight until whoever dispatched it takes it back


def test_the_last_token_ends_the_request_and_forgets_it(tokenizer):
    parts = Parts()
    add_node(parts.registry, "b0", "both")
    req = make_request(tokenizer, "a", max_tokens=2)

    async def scenario():
        await parts.dispatcher.dispatch(req, parts.dispatcher.reroute(req))
        await parts.dispatcher.deliver(req, Token("a", 0, 5))
        assert parts.table.get("a") is req and len(req.outbox) == 1
        await parts.dispatcher.deliver(req, Token("a", 1, 6, finish_reason="length"))

    asyncio.run(scenario())
    assert req.status == RouterRequestStatus.FINISHED and parts.table.get("a") is None
    assert not parts.registry.nodes["b0"].request_ids
    assert parts.value("pdserve_request_success_total", {"finished_reason": "length"}) == 1
    assert len(parts.send.sent) == 1  # the PrefillRequest only: the node ended it itself


def test_fail_pushes_an_error_aborts_on_the_nodes_and_forgets(tokenizer):
    parts = Parts()
    add_node(parts.registry, "p0", "prefill")
    add_node(parts.registry, "d0", "decode")
    req = make_request(tokenizer, "a")

    async def scenario():
        await parts.dispatcher.dispatch(req, parts.dispatcher.reroute(req))
        await parts.dispatcher.fail(req, RouterError("boom", 500, "InternalServerError"))
        await parts.dispatcher.fail(req, RouterError("again", 500, "InternalServerError"))  # ended: nothing

    asyncio.run(scenario())
    assert req.status == RouterRequestStatus.FAILED and req.take_deltas()[0].error.message == "boom"
    assert [(n, type(m).__name__) for n, m in parts.send.sent[1:]] == [("p0", "Abort"), ("d0", "Abort")]
    assert parts.table.get("a") is None and parts.value("pdserve_request_errors_total", {"code": "500"}) == 1


def test_release_aborts_an_unfinished_request_on_its_live_nodes_only(tokenizer):
    parts = Parts()
    add_node(parts.registry, "p0", "prefill")
    add_node(parts.registry, "d0", "decode")
    req = make_request(tokenizer, "a")

    async def scenario():
        await parts.dispatcher.dispatch(req, parts.dispatcher.reroute(req))
        parts.registry.remove("p0")  # a dropped node holds nothing worth aborting
        await parts.dispatcher.release(req, "client disconnected")
        await parts.dispatcher.release(req)  # released twice: the second does nothing

    asyncio.run(scenario())
    assert req.status == RouterRequestStatus.ABORTED and parts.table.get("a") is None
    assert parts.send.sent[1:] == [("d0", Abort("a", "client disconnected"))]
