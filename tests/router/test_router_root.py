"""Router as the composition root: its parts share one registry, one request table and one metrics
object; its views are read-only; closing it fails what it still holds, in flight or parked."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.router.request_state import RouterRequestStatus
from pdserve.router.router import Router
from tests.router.fakes import add_node, make_request

pytestmark = pytest.mark.timeout(30)


def test_the_parts_share_the_registry_the_table_and_the_metrics(tokenizer):
    router = Router(tokenizer, "m", retry_wait_s=7.0, max_retries=2, lost_after_s=3.0)
    assert router.dispatcher.table is router.table and router.redispatcher.table is router.table
    assert router.choices.table is router.table and router.handlers.table is router.table
    assert router.monitor.table is router.table
    assert router.dispatcher.registry is router.registry is router.handlers.registry is router.monitor.registry
    assert router.redispatcher.dispatcher is router.dispatcher and router.choices.redispatcher is router.redispatcher
    assert router.dispatcher.metrics is router.metrics is router.handlers.metrics
    assert (router.redispatcher.max_retries, router.monitor.lost_after_s) == (2, 3.0)
    assert router.retry_wait_s == 7.0
    router.retry_wait_s = 1.0
    assert router.redispatcher.retry_wait_s == 1.0


def test_the_views_are_the_tables_and_read_only(tokenizer):
    router = Router(tokenizer, "m")
    assert router.requests is router.table.in_flight and router.parked is router.table.parked
    assert router.groups is router.table.groups and router.node_keys is router.handlers.node_keys
    with pytest.raises(TypeError):
        router.requests["x"] = None


def test_close_fails_every_request_held(tokenizer):
    router = Router(tokenizer, "m")
    router.control.open()  # the aborts go out on it (to no one: b0 is not connected)
    add_node(router.registry, "b0", "both")
    flying, waiting = make_request(tokenizer, "a"), make_request(tokenizer, "b")
    router.table.dispatched(flying, router.dispatcher.reroute(flying), 3)
    router.table.park(waiting, time.monotonic() + 30, "no node")
    asyncio.run(router.close())
    assert flying.status == waiting.status == RouterRequestStatus.FAILED
    assert flying.take_deltas()[0].error.status == 503 and len(router.table) == 0
