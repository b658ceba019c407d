"""ChoiceGroups alone, on a registry and a request table, with a fake dispatcher and re-dispatcher:
one PrefillRequest for n choices, the request id standing for its choices in heartbeats and
errors, and the release that clears what the nodes hold under the request id."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import Error, PrefillRequest
from pdserve.router.choices import ChoiceGroups
from pdserve.router.openai_protocol import ParsedRequest
from pdserve.router.registry import Registry
from pdserve.router.request_state import RouterRequestStatus
from pdserve.router.request_table import RequestTable
from tests.router.fakes import FakeDispatcher, FakeRedispatcher, add_node

pytestmark = pytest.mark.timeout(30)


class Parts:
    def __init__(self, tokenizer) -> None:
        self.registry = Registry()
        add_node(self.registry, "p0", "prefill")
        add_node(self.registry, "d0", "decode")
        self.table = RequestTable(self.registry)
        self.dispatcher = FakeDispatcher(self.table, self.registry)
        self.dispatcher.admit = lambda parsed: (None, self.registry.route(parsed.prompt_token_ids, 8))
        self.redispatcher = FakeRedispatcher()
        self.groups = ChoiceGroups(self.table, self.dispatcher, self.redispatcher, tokenizer)

    def submit(self, n: int = 3):
        parsed = ParsedRequest("completion", [1, 2, 3], SamplingParams(max_tokens=8, n=n, seed=5), False, False, None)
        return asyncio.run(self.groups.submit("g", parsed))


def test_one_prefill_request_for_every_choice_placed_on_the_same_nodes(tokenizer):
    parts = Parts(tokenizer)
    group = parts.submit(3)
    (_, node_id, msg), = parts.dispatcher.named("send")
    assert node_id == "p0" and isinstance(msg, PrefillRequest) and msg.request_id == "g" and msg.sampling["n"] == 3
    assert [c.request_id for c in group.choices] == ["g#0", "g#1", "g#2"]
    assert [c.sampling.seed for c in group.choices] == [5, 6, 7] and {c.sampling.n for c in group.choices} == {1}
    assert all(parts.table.attempt(c.wire_id) is c for c in group.choices) and parts.table.group("g") is group
    assert group.node_ids == ["p0", "d0"]
    # the prompt is prefilled once: counted with choice 0
    assert parts.registry.nodes["p0"].outstanding_prompt_tokens == {"g#0": 3, "g#1": 0, "g#2": 0}
    assert not parts.redispatcher.calls


def test_an_unreachable_prefill_node_redispatches_each_choice(tokenizer):
    parts = Parts(tokenizer)
    parts.dispatcher.reachable = False
    parts.submit(2)
    assert [c[:2] for c in parts.redispatcher.calls] == [("redispatch", "g#0"), ("redispatch", "g#1")]


def test_the_request_id_in_a_heartbeat_stands_for_its_live_choices_on_that_node(tokenizer):
    parts = Parts(tokenizer)
    group = parts.submit(2)
    group.choices[1].status = RouterRequestStatus.FINISHED
    now = time.monotonic() + 100
    assert parts.groups.listed("d0", "g", now)
    assert group.choices[0].last_listed == now and group.choices[1].last_listed < now
    assert not parts.groups.listed("d9", "g", now)  # not dispatched there
    assert not parts.groups.listed("d0", "other", now)  # no such group


def test_an_error_for_the_request_id_applies_to_each_live_choice(tokenizer):
    parts = Parts(tokenizer)
    group = parts.submit(2)
    assert asyncio.run(parts.groups.on_error(Error("g", "d0", "KV transfer failed", retryable=True)))
    assert [c[:2] for c in parts.redispatcher.calls] == [("redispatch", "g#0"), ("redispatch", "g#1")]
    assert asyncio.run(parts.groups.on_error(Error("g", "p0", "bad", retryable=False)))
    assert parts.dispatcher.named("fail") == [("fail", "g#0", 500), ("fail", "g#1", 500)]
    assert all(c.status == RouterRequestStatus.FAILED for c in group.choices)
    assert not asyncio.run(parts.groups.on_error(Error("g", "p0", "late", retryable=True)))  # none live


def test_release_releases_each_choice_and_aborts_the_request_id_unless_all_finished(tokenizer):
    parts = Parts(tokenizer)
    group = parts.submit(2)
    asyncio.run(parts.groups.release(group))
    assert [c[1] for c in parts.dispatcher.named("release")] == ["g#0", "g#1"]
    assert parts.dispatcher.named("abort_on") == [("abort_on", "g", ["p0", "d0"])]
    assert parts.table.group("g") is None and len(parts.table) == 0

    finished = Parts(tokenizer)
    group = finished.submit(2)
    for c in group.choices:
        c.status = RouterRequestStatus.FINISHED
    asyncio.run(finished.groups.release(group))
    assert not finished.dispatcher.named("abort_on") and finished.table.group("g") is None


def test_a_choice_on_its_own_later_attempt_no_longer_answers_to_the_request_id(tokenizer):
    parts = Parts(tokenizer)
    group = parts.submit(2)
    moved = group.choices[0]
    parts.table.forget(moved)
    moved.next_attempt()
    now = time.monotonic() + 100
    assert parts.groups.listed("d0", "g", now) and moved.last_listed < now  # choice 1 only
