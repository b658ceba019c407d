"""NodeMessages alone, on a registry and a request table, with fakes for the control socket, the
dispatcher, the re-dispatcher and the n > 1 groups: what each node message does."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.protocol.messages import (
    Abort,
    Deregister,
    Error,
    FirstToken,
    Heartbeat,
    MessageError,
    PrefillRequest,
    Register,
    Reregister,
    Token,
    TokenBatch,
)
from pdserve.router.handlers import NodeMessages
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import Registry
from pdserve.router.request_table import RequestTable
from tests.router.fakes import FakeDispatcher, FakeRedispatcher, add_node, make_request

pytestmark = pytest.mark.timeout(30)


class FakeControl:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    async def send(self, identity: bytes, node_id: str, msg, log_level: int = 0) -> bool:
        self.sent.append((node_id, msg))
        return True


class FakeGroups:
    def __init__(self) -> None:
        self.listed_ids: set[str] = set()
        self.errors: list = []

    def listed(self, node_id: str, request_id: str, now: float) -> bool:
        return request_id in self.listed_ids

    async def on_error(self, msg) -> bool:
        self.errors.append(msg.request_id)
        return msg.request_id in self.listed_ids


class Parts:
    def __init__(self, heartbeat_timeout_s: float = 5.0) -> None:
        self.registry = Registry(heartbeat_timeout_s)
        self.table = RequestTable(self.registry)
        self.control = FakeControl()
        self.metrics = RouterMetrics()
        self.dispatcher = FakeDispatcher(self.table, self.registry)
        self.redispatcher = FakeRedispatcher()
        self.groups = FakeGroups()
        self.handlers = NodeMessages("m", self.registry, self.table, self.control, self.metrics, self.dispatcher,
                                     self.redispatcher, self.groups)

    def handle(self, msg, identity: bytes | None = None, peer_key: str | None = None) -> None:
        node_id = getattr(msg, "node_id", "")
        asyncio.run(self.handlers.on_message(identity if identity is not None else node_id.encode(), msg, peer_key))

    def dispatched(self, tokenizer, request_id: str, max_tokens: int = 8):
        req = make_request(tokenizer, request_id, max_tokens=max_tokens)
        asyncio.run(self.dispatcher.dispatch(req, self.dispatcher.reroute(req)))
        return req


def pair(parts: Parts) -> None:
    add_node(parts.registry, "p0", "prefill")
    add_node(parts.registry, "d0", "decode")


def test_messages_not_for_the_router_and_unknown_roles_are_refused():
    parts = Parts()
    with pytest.raises(MessageError):
        parts.handle(PrefillRequest("r", [1], {}))
    with pytest.raises(MessageError):
        parts.handle(Register("x", "cook", "m"))
    assert not parts.registry.nodes


def test_a_node_registering_again_keeps_its_requests_with_its_pid_and_loses_them_with_another(tokenizer):
    parts = Parts()
    pair(parts)
    parts.dispatched(tokenizer, "a")
    parts.handle(Register("d0", "decode", "m", kv_addr="tcp://d0", pid=1))  # reconnected, same process
    assert parts.registry.nodes["d0"].request_ids == {"a"} and not parts.redispatcher.calls
    parts.handle(Register("d0", "decode", "m", kv_addr="tcp://d0", pid=2))  # restarted
    assert parts.redispatcher.calls == [("node_lost", "d0", "node d0 restarted")]
    assert parts.registry.nodes["d0"].request_ids == set()


def test_deregister_drops_the_node_and_its_requests_go_elsewhere():
    parts = Parts()
    pair(parts)
    parts.handle(Deregister("d0"))
    assert "d0" not in parts.registry.nodes and parts.redispatcher.calls == [("node_lost", "d0", "node d0 left")]
    parts.handle(Deregister("d0"))  # unknown by now: nothing
    assert len(parts.redispatcher.calls) == 1


def test_a_heartbeat_from_an_unknown_node_asks_it_to_register_once_per_timeout():
    parts = Parts(heartbeat_timeout_s=60)
    parts.handle(Heartbeat("x", 1, 1, 0, 0))
    parts.handle(Heartbeat("x", 1, 1, 0, 0))
    assert parts.control.sent == [("x", Reregister("unknown node"))]
    parts.handle(Register("x", "both", "m"))  # registered: the next time it is unknown, it is asked again
    parts.registry.remove("x")
    parts.handle(Heartbeat("x", 1, 1, 0, 0))
    assert len(parts.control.sent) == 2


def test_a_heartbeat_refreshes_its_requests_aborts_strangers_and_unparks(tokenizer):
    parts = Parts()
    pair(parts)
    req = parts.dispatched(tokenizer, "a")
    req.last_listed = 0.0
    parts.groups.listed_ids = {"g"}
    parts.table.park(make_request(tokenizer, "parked"), time.monotonic() + 30, "no node")
    parts.handle(Heartbeat("d0", 90, 100, 1, 0, request_ids=["a", "g", "old~1"]))
    assert req.last_listed > 0
    assert parts.dispatcher.named("send") == [("send", "d0", Abort("old~1", "unknown to the router"))]
    assert parts.redispatcher.calls == [("unpark",)]


def test_the_first_token_ends_the_prompt_accounting_and_is_delivered(tokenizer):
    parts = Parts()
    pair(parts)
    req = parts.dispatched(tokenizer, "a")
    assert parts.registry.nodes["p0"].outstanding_prompt_tokens == {"a": 3}
    parts.handle(FirstToken("a", 42, queued_s=0.5, prefill_s=0.25, num_cached_tokens=2), identity=b"p0")
    assert parts.registry.nodes["p0"].outstanding_prompt_tokens == {}
    assert (req.timing.prefill_queued_s, req.timing.prefill_s, req.timing.num_cached_tokens) == (0.5, 0.25, 2)
    assert parts.dispatcher.named("deliver") == [("deliver", "a", 0)]
    parts.handle(FirstToken("gone", 1), identity=b"p0")  # unknown: dropped
    assert len(parts.dispatcher.named("deliver")) == 1


def test_a_token_batch_counts_only_for_the_requests_its_node_holds(tokenizer):
    parts = Parts()
    pair(parts)
    add_node(parts.registry, "d9", "decode")
    mine = parts.dispatched(tokenizer, "a")
    mine.output_token_ids.append(5)  # index 0 is in
    tokens = [Token("a", 1, 6), Token("unknown", 1, 6)]
    parts.handle(TokenBatch.from_tokens("d9", tokens))  # not d9's request
    assert not parts.dispatcher.named("delivered")
    parts.handle(TokenBatch.from_tokens(mine.decode_node_id, tokens))
    assert parts.dispatcher.named("delivered") == [("delivered", "a", [6])]


def test_a_node_error_redispatches_or_fails_the_request_it_names(tokenizer):
    parts = Parts()
    pair(parts)
    req = parts.dispatched(tokenizer, "a")
    parts.handle(Error("a", "d9", "a stranger's", retryable=True))
    assert not parts.redispatcher.calls
    parts.handle(Error("a", req.decode_node_id, "KV transfer failed", retryable=True))
    assert parts.redispatcher.calls == [("redispatch", "a", f"node {req.decode_node_id}: KV transfer failed")]
    parts.handle(Error("a", "p0", "bad prompt"))
    assert parts.dispatcher.named("fail") == [("fail", "a", 500)]
    parts.groups.listed_ids = {"g"}
    parts.handle(Error("g", "p0", "for the group"))
    assert parts.groups.errors == ["g"] and len(parts.dispatcher.named("fail")) == 1


def test_a_node_id_is_bound_to_the_key_it_first_registered_with(tokenizer):
    parts = Parts()
    parts.handle(Register("p0", "prefill", "m"), peer_key="K1")
    assert parts.handlers.node_keys == {"p0": "K1"}
    parts.handle(Register("p0", "decode", "m"), identity=b"other", peer_key="K2")  # refused: not registered
    parts.handle(Heartbeat("p0", 1, 1, 0, 0), identity=b"other", peer_key="K2")
    parts.handle(Heartbeat("p0", 1, 1, 0, 0), identity=b"other", peer_key="K2")
    assert parts.registry.nodes["p0"].role == "prefill" and parts.registry.nodes["p0"].heartbeat is None
    assert parts.handlers.taken_logged == {("p0", "K2")}
    get = parts.metrics.registry.get_sample_value
    assert get("pdserve_auth_refusals_total", {"reason": "node_id_taken"}) == 3
    # another key over the node's own routing id: its connection was taken over, so it is dropped
    parts.handle(Heartbeat("p0", 1, 1, 0, 0), identity=b"p0", peer_key="K2")
    assert "p0" not in parts.registry.nodes
    assert parts.redispatcher.calls == [("node_lost", "p0", "node p0's connection was taken over")]
