"""Registry: liveness, readiness, and the routing policies (no sockets)."""

from __future__ import annotations

import pytest

from pdserve.protocol.messages import Heartbeat, Register
from pdserve.router.registry import NoNodeError, OverloadedError, Registry


def add(reg: Registry, node_id: str, role: str, *, free: int = 100, ready: bool = True, now: float = 0.0,
        outstanding: int = 0, max_model_len: int = 0, block_size: int = 16) -> None:
    reg.register(Register(node_id, role, "m", kv_addr=f"tcp://{node_id}", num_total_blocks=100,
                          block_size=block_size, max_model_len=max_model_len), node_id.encode(), now=now)
    reg.heartbeat(Heartbeat(node_id, free, 100, 0, 0, num_outstanding_tokens=outstanding, ready=ready), now=now)


def test_node_is_eligible_only_after_a_ready_heartbeat():
    reg = Registry()
    reg.register(Register("b", "both", "m"), b"b", now=0.0)
    assert not reg.is_healthy()
    with pytest.raises(NoNodeError):
        reg.route([1, 2], 4)
    reg.heartbeat(Heartbeat("b", 10, 10, 0, 0, ready=False), now=0.0)
    assert not reg.is_healthy()
    reg.heartbeat(Heartbeat("b", 10, 10, 0, 0, ready=True), now=0.0)
    assert reg.is_healthy()


def test_missed_heartbeats_drop_the_node_and_unknown_heartbeats_are_refused():
    reg = Registry(heartbeat_timeout_s=5.0)
    add(reg, "a", "both", now=0.0)
    add(reg, "b", "both", now=3.0)
    assert [n.node_id for n in reg.expire(now=6.0)] == ["a"]
    assert list(reg.nodes) == ["b"]
    assert not reg.heartbeat(Heartbeat("a", 1, 1, 0, 0), now=6.0)


def test_only_both_nodes_are_colocated():
    reg = Registry()
    add(reg, "b", "both")
    route = reg.route([1, 2, 3], 4)
    assert route.prefill.node_id == "b" and route.decode is None and route.node_ids == ["b"]


def test_split_route_and_missing_roles():
    reg = Registry()
    add(reg, "p", "prefill")
    with pytest.raises(NoNodeError, match="decode"):
        reg.route([1], 4)
    assert not reg.is_healthy()
    add(reg, "d", "decode")
    route = reg.route([1], 4)
    assert (route.prefill.node_id, route.decode.node_id) == ("p", "d")
    reg.remove("p")
    with pytest.raises(NoNodeError, match="prefill"):
        reg.route([1], 4)


def test_prefill_goes_to_least_outstanding_tokens():
    reg = Registry()
    add(reg, "p0", "prefill")
    add(reg, "p1", "prefill", outstanding=50)  # the heartbeat's own count
    add(reg, "d", "decode")
    first = reg.route(list(range(100)), 4)
    assert first.prefill.node_id == "p0"
    reg.add_request(first, "r1", 100, 4)  # p0 now has 100 outstanding in the router's count
    assert reg.route([1], 4).prefill.node_id == "p1"
    reg.first_token("p0", "r1")  # the prompt is done: p0 is free again
    assert reg.route([1], 4).prefill.node_id == "p0"


def test_decode_goes_to_most_free_blocks_minus_recent_dispatches():
    reg = Registry()
    add(reg, "p", "prefill")
    add(reg, "d0", "decode", free=100)
    add(reg, "d1", "decode", free=90)
    route = reg.route(list(range(16 * 10)), 16 * 10)  # 20 blocks
    assert route.decode.node_id == "d0"
    reg.add_request(route, "r1", 160, 160)
    assert reg.nodes["d0"].free_blocks == 80
    assert reg.route([1], 1).decode.node_id == "d1"
    reg.heartbeat(Heartbeat("d0", 100, 100, 0, 0), now=None)  # the truth again: the estimate is reset
    assert reg.route([1], 1).decode.node_id == "d0"


def test_release_request_clears_accounting():
    reg = Registry()
    add(reg, "p", "prefill")
    add(reg, "d", "decode")
    route = reg.route([1, 2, 3], 4)
    reg.add_request(route, "r1", 3, 4)
    assert reg.nodes["p"].request_ids == {"r1"} == reg.nodes["d"].request_ids
    reg.release_request(route.node_ids, "r1")
    assert not reg.nodes["p"].request_ids and not reg.nodes["d"].request_ids
    assert reg.nodes["p"].prefill_load == 0


def test_prefix_affinity_is_sticky_and_spreads_and_respects_load():
    reg = Registry(prefix_affinity=True, affinity_slack_tokens=100)
    for i in range(4):
        add(reg, f"b{i}", "both")
    prompts = [[i] * 70 + [j] for i in range(20) for j in range(2)]
    chosen = {tuple(p[:64]): reg.pick_prefill(p).node_id for p in prompts}
    for p in prompts:  # tokens after the first 64 do not matter, and the choice is stable
        assert reg.pick_prefill(p).node_id == chosen[tuple(p[:64])]
    assert len(set(chosen.values())) > 1
    favourite = reg.pick_prefill(prompts[0]).node_id
    reg.nodes[favourite].outstanding_prompt_tokens["busy"] = 1000  # beyond the slack
    assert reg.pick_prefill(prompts[0]).node_id != favourite


def test_max_model_len_is_the_smallest_declared_by_ready_nodes():
    reg = Registry()
    assert reg.max_model_len() is None
    add(reg, "a", "prefill", max_model_len=128)
    add(reg, "b", "decode", max_model_len=64)
    add(reg, "c", "decode", max_model_len=32, ready=False)
    add(reg, "d", "decode", max_model_len=0)
    assert reg.max_model_len() == 64


def _two_router_views(max_num_seqs: int = 4, max_queue: int = 2) -> tuple[Registry, Registry]:
    """Two routers' registries of one prefill and one decode node (as with --api-server-count 2)."""
    views = []
    for _ in range(2):
        reg = Registry(max_queue=max_queue)
        add(reg, "p", "prefill")
        reg.register(Register("d", "decode", "m", kv_addr="tcp://d", num_total_blocks=100, max_num_seqs=max_num_seqs),
                     b"d", now=0.0)
        reg.heartbeat(Heartbeat("d", 100, 100, 0, 0), now=0.0)
        views.append(reg)
    return views[0], views[1]


def _fill(reg: Registry, prefix: str) -> list[str]:
    """Route requests until the decode node is saturated in this router's view; their ids."""
    ids = []
    while True:
        try:
            route = reg.route([1, 2, 3], 4)
        except OverloadedError as e:
            assert str(e) == "decode"
            return ids
        ids.append(f"{prefix}{len(ids)}")
        reg.add_request(route, ids[-1], 3, 4)
        reg.first_token("p", ids[-1])  # the prefill queue is not what is tested


def test_two_routers_do_not_double_book_a_decode_node():
    a, b = _two_router_views(max_num_seqs=4, max_queue=2)  # the node takes 4 + 2 queued
    a_ids = _fill(a, "a")
    assert len(a_ids) == 6
    # The node's next heartbeat counts A's 6 requests; it lists them to A only (node/router_links.py).
    a.heartbeat(Heartbeat("d", 90, 100, 4, 2, request_ids=a_ids), now=1.0)
    b.heartbeat(Heartbeat("d", 90, 100, 4, 2, request_ids=[]), now=1.0)
    assert a.nodes["d"].decode_load == b.nodes["d"].decode_load == 6
    with pytest.raises(OverloadedError):  # B sees the node full of A's requests
        b.route([1, 2, 3], 4)
    # A's requests end; once the node says so, B may use the room, and A only what B left.
    for rid in a_ids[:3]:
        a.release_request(["p", "d"], rid)
    b.heartbeat(Heartbeat("d", 95, 100, 3, 0, request_ids=[]), now=2.0)
    b_ids = _fill(b, "b")
    assert len(b_ids) == 3
    a.heartbeat(Heartbeat("d", 90, 100, 4, 2, request_ids=a_ids[3:]), now=3.0)
    assert a.nodes["d"].decode_load == 6 and _fill(a, "a2-") == []


def test_one_router_counts_only_its_own_requests_on_a_decode_node():
    reg, _ = _two_router_views(max_num_seqs=4, max_queue=2)
    ids = _fill(reg, "r")
    assert len(ids) == 6
    # Some still pulling their KV (held, listed, not yet running): the heartbeat adds nothing.
    reg.heartbeat(Heartbeat("d", 90, 100, 3, 0, request_ids=ids), now=1.0)
    assert reg.nodes["d"].decode_load == 6
    reg.release_request(["p", "d"], ids[0])
    assert reg.nodes["d"].decode_load == 5  # an ended request frees its place at once
    assert len(_fill(reg, "s")) == 1
