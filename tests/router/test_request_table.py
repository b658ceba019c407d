"""RequestTable alone: one entry per request, by request id; the in-flight view by wire id, the
parked ones, n > 1 groups; the registry's node holdings follow; `forget` clears every part."""

from __future__ import annotations

import pytest

from pdserve.router.choice_group import ChoiceGroup
from pdserve.router.registry import Registry
from pdserve.router.request_table import RequestTable
from tests.router.fakes import add_node, make_request

pytestmark = pytest.mark.timeout(30)


def table_with_nodes():
    reg = Registry()
    add_node(reg, "p0", "prefill")
    add_node(reg, "d0", "decode")
    return reg, RequestTable(reg)


def test_a_dispatched_request_is_in_flight_under_its_wire_id_and_held_by_its_nodes(tokenizer):
    reg, table = table_with_nodes()
    req = make_request(tokenizer, "a")
    table.dispatched(req, reg.route(req.prompt_token_ids, 8), 3)
    assert table.get("a") is req and "a" in table and len(table) == 1
    assert table.attempt("a") is req and dict(table.in_flight) == {"a": req}
    assert (req.prefill_node_id, req.decode_node_id) == ("p0", "d0") and req.status.value == "prefilling"
    assert reg.nodes["p0"].outstanding_prompt_tokens == {"a": 3} and reg.nodes["p0"].request_ids == {"a"}
    assert reg.nodes["d0"].request_ids == {"a"} and reg.nodes["d0"].blocks_since_heartbeat == 1
    table.first_token(req)
    assert reg.nodes["p0"].outstanding_prompt_tokens == {} and reg.nodes["p0"].request_ids == {"a"}
    table.check_invariants()


def test_forget_clears_the_entry_the_wire_id_and_the_node_holdings_at_once(tokenizer):
    reg, table = table_with_nodes()
    req = make_request(tokenizer, "a")
    table.dispatched(req, reg.route(req.prompt_token_ids, 8), 3)
    table.forget(req)
    assert table.get("a") is None and not table.in_flight and len(table) == 0
    assert not reg.nodes["p0"].outstanding_prompt_tokens and not reg.nodes["p0"].request_ids
    assert not reg.nodes["d0"].request_ids
    table.forget(req)  # twice: nothing left to clear
    table.check_invariants()


def test_a_later_attempt_is_found_by_its_own_wire_id_only(tokenizer):
    reg, table = table_with_nodes()
    req = make_request(tokenizer, "a")
    table.dispatched(req, reg.route(req.prompt_token_ids, 8), 3)
    table.forget(req)
    req.next_attempt()
    table.dispatched(req, reg.route(req.attempt_prompt_ids, 8), 3)
    assert table.attempt("a") is None and table.attempt("a~1") is req and table.get("a") is req
    assert reg.nodes["d0"].request_ids == {"a~1"}
    table.check_invariants()


def test_a_parked_request_is_held_apart_from_the_in_flight_ones(tokenizer):
    reg, table = table_with_nodes()
    flying, waiting = make_request(tokenizer, "a"), make_request(tokenizer, "b")
    table.dispatched(flying, reg.route(flying.prompt_token_ids, 8), 3)
    table.park(waiting, 12.5, "no decode node")
    assert len(table) == 2 and list(table.in_flight) == ["a"] and list(table.parked) == ["b"]
    assert table.parked["b"].req is waiting and table.parked["b"].wait_until == 12.5
    assert table.entry("b").parked.reason == "no decode node" and table.entry("a").parked is None
    assert list(table.requests()) == [flying, waiting]  # in flight first, then parked
    table.check_invariants()
    table.unpark("b")
    assert table.get("b") is None and not table.parked and len(table) == 1
    table.park(waiting, 1.0, "again")
    table.forget(waiting)  # a parked request forgotten (failed, released) leaves as well
    assert not table.parked and len(table) == 1
    table.check_invariants()


def test_the_views_are_read_only(tokenizer):
    _, table = table_with_nodes()
    with pytest.raises(TypeError):
        table.in_flight["x"] = make_request(tokenizer, "x")
    with pytest.raises(TypeError):
        table.parked["x"] = None


def test_groups_live_from_add_to_drop_whatever_their_choices_do(tokenizer):
    reg, table = table_with_nodes()
    choices = [make_request(tokenizer, f"g#{i}") for i in range(2)]

    class Parsed:
        sampling = choices[0].sampling

    group = ChoiceGroup("g", Parsed, choices)
    table.add_group(group)
    route = reg.route([1, 2, 3], 8)
    for i, c in enumerate(choices):
        table.dispatched(c, route, 3 if i == 0 else 0)
    assert table.group("g") is group and dict(table.groups) == {"g": group}
    assert reg.nodes["p0"].outstanding_prompt_tokens == {"g#0": 3, "g#1": 0}
    for c in choices:
        table.forget(c)
    assert table.group("g") is group and len(table) == 0  # the group outlives its choices' attempts
    table.drop_group(ChoiceGroup("g", Parsed, choices))  # another group object under the id: kept
    assert table.group("g") is group
    table.drop_group(group)
    assert table.group("g") is None
