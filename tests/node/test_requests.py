"""The node's request table alone (node/requests.py): admission and stages, origins noted before
admission and orphaned when a router goes, families of n > 1 choices, forgetting on every path,
the per-stage counts and the timing records the status endpoint reads."""

from __future__ import annotations

import pytest

from pdserve.node.requests import NodeRequests, Stage, table_of
from pdserve.protocol.messages import KVReady, PrefillRequest


def ready(request_id: str) -> KVReady:
    return KVReady(request_id, [3, 4, 5], 7, None, {}, 3, [4, 9], 16, 30.0)


def test_a_prefill_request_from_admission_to_its_lease_released():
    table = NodeRequests()
    table.set_origin("r1", "tcp://router:1")  # the router links noted where it came from
    assert table.stage("r1") is Stage.RECEIVED and table.held_ids() == [] and len(table) == 1
    msg = PrefillRequest("r1", [1, 2, 3], {}, "d0", "tcp://d0:9")
    entry = table.admit("r1", Stage.PREFILLING, handoff=msg)
    assert entry.origin == "tcp://router:1" and entry.handoff is msg and table.held_ids() == ["r1"]
    table.move("r1", Stage.HANDED_OFF, kv_ready=ready("r1"))
    assert table.get("r1").block_ids == [4, 9] and table.num(Stage.HANDED_OFF) == 1
    assert table.forget("r1") is entry
    assert "r1" not in table and table.origin("r1") == "" and table.num(Stage.HANDED_OFF) == 0
    assert table.forget("r1") is None  # once only


def test_admitting_twice_or_at_received_is_refused():
    table = NodeRequests()
    table.admit("r1", Stage.WAITING_FOR_KV)
    with pytest.raises(ValueError, match="already held"):
        table.admit("r1", Stage.WAITING_FOR_KV)
    with pytest.raises(ValueError):
        table.admit("r2", Stage.RECEIVED)
    with pytest.raises(KeyError):
        table.move("r2", Stage.DECODING)
    with pytest.raises(TypeError, match="no field"):
        table.move("r1", Stage.RECEIVING_KV, blocks=[1])


def test_a_refusal_forgets_only_what_was_not_taken():
    table = NodeRequests()
    table.set_origin("new", "tcp://a:1")
    table.admit("held", Stage.DECODING)
    table.set_origin("held", "tcp://a:1")  # a duplicate id from the router: the held one stays
    table.forget_unadmitted("new")
    table.forget_unadmitted("held")
    table.forget_unadmitted("unknown")
    assert table.held_ids() == ["held"] and len(table) == 1


def test_choices_form_a_family_with_their_request():
    table = NodeRequests()
    table.admit("a", Stage.PREFILLING, origin="tcp://a:1")
    for i in range(3):
        table.admit(f"a#{i}", Stage.COLOCATED, parent_id="a", origin=table.origin("a"))
    table.forget("a")  # forked: the choices stand for it
    table.admit("b", Stage.PREFILLING)
    assert table.family("a") == ["a#0", "a#1", "a#2"] and table.family("a#1") == ["a#1"]
    assert table.origin("a#2") == "tcp://a:1" and table.num(Stage.COLOCATED) == 3
    for rid in table.family("a"):
        table.forget(rid)
    assert table.held_ids() == ["b"] and table.num(Stage.COLOCATED) == 0


def test_a_gone_router_orphans_its_requests_once():
    table = NodeRequests()
    table.admit("ra", Stage.DECODING, origin="tcp://a:1")
    table.set_origin("rb", "tcp://b:1")
    table.admit("rb", Stage.WAITING_FOR_KV)
    assert table.orphan("tcp://a:1") == ["ra"]
    assert table.orphan("tcp://a:1") == []  # its requests are no router's now: listed once
    assert table.origin("ra") == "" and table.origin("rb") == "tcp://b:1" and "ra" in table


def test_counts_follow_every_move_and_forget():
    table = NodeRequests()
    for rid in ("r1", "r2", "r3"):
        table.admit(rid, Stage.WAITING_FOR_KV)
    table.move("r1", Stage.RECEIVING_KV)
    table.move("r1", Stage.DECODING)
    table.move("r2", Stage.RECEIVING_KV)
    assert [table.num(s) for s in (Stage.WAITING_FOR_KV, Stage.RECEIVING_KV, Stage.DECODING)] == [1, 1, 1]
    for rid in ("r1", "r2", "r3"):
        table.forget(rid)
    assert all(table.num(s) == 0 for s in Stage) and len(table) == 0


def test_timing_records_outlive_their_request_and_are_bounded():
    table = NodeRequests(recent=2)
    table.admit("r1", Stage.PREFILLING)
    record = table.log("r1", {"received": 1.0, "first_token": 2.0})
    table.note("r1", "kv_released", at=3.0)
    table.forget("r1")
    table.note("r1", "late", at=4.0)  # forgotten: nothing more is stamped
    assert record == {"request_id": "r1", "received": 1.0, "first_token": 2.0, "kv_released": 3.0}
    assert list(table.recent) == [record]
    table.log("r2", {})  # a request not held still gets its record
    table.log("r3", {})
    assert [t["request_id"] for t in table.recent] == ["r2", "r3"]


def test_a_node_shares_its_router_links_table():
    class Links:
        requests = NodeRequests()

    class Link:  # one router: no table of its own
        pass

    assert table_of(Links()) is Links.requests
    assert isinstance(table_of(Link()), NodeRequests)
