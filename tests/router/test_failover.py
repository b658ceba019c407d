"""Re-dispatch: a node that dies mid-request, a failed KV hand-off, a message lost with a node,
the retry limit, a node the router forgot re-registering, reconciliation of what nodes hold, and
429s when every node is at its queue limit. The fakes generate token = f(previous token), so a
request continued from "prompt + tokens streamed so far" must produce exactly the undisturbed
output: any gap, duplicate or reordering shows up in the text."""

from __future__ import annotations

import asyncio

from pdserve.protocol.messages import Heartbeat
from tests.router.conftest import run, serving, wait_until
from tests.router.fake_node import FakeNode

BODY = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "return_token_ids": True}


def cluster(*specs: tuple[str, str, dict]) -> list[FakeNode]:
    shared: dict[str, FakeNode] = {}
    return [FakeNode(node_id, role, cluster=shared, **kw) for node_id, role, kw in specs]


async def reference(h) -> dict:
    status, body = await h.post("/v1/completions", BODY)
    assert status == 200, body
    return body["choices"][0]


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))


def test_decode_node_death_mid_stream_continues_on_another(tokenizer):
    async def scenario():
        p0, d0, d1 = cluster(("p0", "prefill", {}), ("d0", "decode", {"token_delay_s": 0.02}),
                             ("d1", "decode", {"token_delay_s": 0.02}))
        async with serving(tokenizer, p0, d0, d1, heartbeat_timeout_s=0.3) as h:
            expected = await reference(h)
            victim = {}

            async def kill_when_streaming():
                await wait_until(lambda: d0.tasks or d1.tasks, what="decoding")
                await asyncio.sleep(0.2)  # some tokens out
                node = d0 if d0.tasks else d1
                node.heartbeating = False  # dead to the router; its late tokens must be ignored
                victim["node"] = node

            killer = asyncio.create_task(kill_when_streaming())
            events = await h.stream("/v1/completions", BODY)
            await killer
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            assert text_of(events) == expected["text"]
            assert h.router.metrics.retries._value.get() == 1
            survivor = d1 if victim["node"] is d0 else d0
            retried = [p for p in p0.prefills if "~1" in p.request_id]
            assert len(retried) == 1 and retried[0].decode_node_id == survivor.node_id
            # The continuation's prompt is the original plus what was streamed before the death.
            streamed = len(retried[0].prompt_token_ids) - len(p0.prefills[0].prompt_token_ids)
            assert streamed > 0 and retried[0].num_prior_output_tokens == streamed
            assert not h.router.requests

    run(scenario())


def test_prefill_node_death_before_first_token(tokenizer):
    async def scenario():
        p0, p1, d0 = cluster(("p0", "prefill", {"first_token_delay_s": 5.0}), ("p1", "prefill", {}),
                             ("d0", "decode", {}))
        async with serving(tokenizer, p0, d0, heartbeat_timeout_s=0.3) as h:
            task = asyncio.create_task(h.post("/v1/completions", BODY))
            await wait_until(lambda: p0.prefills, what="queued on p0")
            await h.add_node(p1)
            p0.heartbeating = False
            status, body = await task
            assert status == 200 and len(body["choices"][0]["token_ids"]) == BODY["max_tokens"]
            assert [p.request_id.endswith("~1") for p in p1.prefills] == [True]
            assert p1.prefills[0].prompt_token_ids == p0.prefills[0].prompt_token_ids  # nothing streamed yet

    run(scenario())


def test_retryable_error_is_retried_then_gives_up(tokenizer):
    async def scenario():
        (p0,) = cluster(("p0", "both", {"fail": "KV transfer failed", "retryable": True}))
        async with serving(tokenizer, p0, max_retries=2) as h:
            status, body = await h.post("/v1/completions", BODY)
            assert status == 503 and "gave up after 2 retries" in body["error"]["message"]
            assert len(p0.prefills) == 3 and not h.router.requests
            p0.fail = None
            status, body = await h.post("/v1/completions", BODY)
            assert status == 200

    run(scenario())


def test_transient_transfer_failure_is_invisible_to_the_client(tokenizer):
    async def scenario():
        p0, d0 = cluster(("p0", "prefill", {}), ("d0", "decode", {}))
        async with serving(tokenizer, p0, d0) as h:
            expected = await reference(h)
            d0.fail, d0.retryable, d0.token_delay_s = "KV transfer failed: no KV data within 2 s", True, 0.3
            task = asyncio.create_task(h.post("/v1/completions", BODY))
            await wait_until(lambda: d0.tasks, what="the first attempt on d0")
            d0.fail, d0.token_delay_s = None, 0.0  # its Error is on the way; the retry succeeds
            status, body = await task
            assert status == 200 and body["choices"][0]["text"] == expected["text"]

    run(scenario())


def test_a_lost_request_is_redispatched(tokenizer):
    async def scenario():
        p0, d0 = cluster(("p0", "prefill", {}), ("d0", "decode", {}))
        async with serving(tokenizer, p0, d0, lost_after_s=0.5) as h:
            p0.swallow = 1  # the PrefillRequest vanishes: no node ever lists it
            status, body = await h.post("/v1/completions", BODY)
            assert status == 200 and len(body["choices"][0]["token_ids"]) == BODY["max_tokens"]
            assert len(p0.prefills) == 2 and h.router.metrics.retries._value.get() == 1

    run(scenario())


def test_dropped_node_is_asked_to_register_again(tokenizer):
    async def scenario():
        p0, d0 = cluster(("p0", "prefill", {}), ("d0", "decode", {}))
        async with serving(tokenizer, p0, d0, heartbeat_timeout_s=0.3) as h:
            d0.heartbeating = False
            await wait_until(lambda: "d0" not in h.router.registry.nodes, what="d0 dropped")
            assert (await h.client.get("/health")).status == 503
            d0.heartbeating = True
            await wait_until(lambda: d0.reregisters == 1 and "d0" in h.router.registry.nodes
                             and h.router.registry.nodes["d0"].ready, what="d0 back")
            assert (await h.client.get("/health")).status == 200
            assert (await h.post("/v1/completions", BODY))[0] == 200

    run(scenario())


def test_heartbeat_listing_unknown_requests_gets_them_aborted(tokenizer):
    async def scenario():
        p0, d0 = cluster(("p0", "prefill", {}), ("d0", "decode", {}))
        async with serving(tokenizer, p0, d0):
            d0.heartbeating = False
            await d0.send(Heartbeat("d0", 900, 1000, 1, 0, request_ids=["cmpl-from-before-a-restart"]))
            await wait_until(lambda: "cmpl-from-before-a-restart" in d0.aborted_ids, what="abort")
            d0.heartbeating = True

    run(scenario())


def test_overload_is_429_with_retry_after(tokenizer):
    async def scenario():
        p0, d0 = cluster(("p0", "prefill", {"first_token_delay_s": 1.0}), ("d0", "decode", {}))
        async with serving(tokenizer, p0, d0, max_queue=2) as h:
            first = [asyncio.create_task(h.post("/v1/completions", BODY)) for _ in range(2)]
            await wait_until(lambda: len(p0.prefills) == 2, what="two queued")
            resp = await h.client.post("/v1/completions", json=BODY)
            body = await resp.json()
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert body["error"]["code"] == 429 and "queue limit" in body["error"]["message"]
            assert [(await t)[0] for t in first] == [200, 200]
            assert (await h.post("/v1/completions", BODY))[0] == 200  # room again

    run(scenario())


def test_decode_queue_limit_counts_beyond_max_num_seqs(tokenizer):
    async def scenario():
        p0, d0 = cluster(("p0", "prefill", {}), ("d0", "decode", {"max_num_seqs": 1, "token_delay_s": 0.05}))
        async with serving(tokenizer, p0, d0, max_queue=1) as h:
            running = []
            for n in (1, 2):  # one at a time: the prefill queue limit (1) must not be what refuses
                running.append(asyncio.create_task(h.post("/v1/completions", BODY)))
                await wait_until(lambda n=n: len(h.router.requests) == n and len(d0.tasks) == n, what=f"{n} decoding")
            status, _ = await h.post("/v1/completions", BODY)
            assert status == 429
            assert [(await t)[0] for t in running] == [200, 200]

    run(scenario())


def test_redispatch_waits_for_a_node_to_come_back(tokenizer):
    async def scenario():
        p0, d0, d1 = cluster(("p0", "prefill", {}), ("d0", "decode", {"token_delay_s": 0.02}),
                             ("d1", "decode", {"token_delay_s": 0.02}))
        async with serving(tokenizer, p0, d0, heartbeat_timeout_s=0.3, retry_wait_s=10) as h:
            expected = await reference(h)
            task = asyncio.create_task(h.stream("/v1/completions", BODY))
            await wait_until(lambda: d0.tasks, what="decoding on d0")
            await asyncio.sleep(0.2)
            d0.heartbeating = False  # the only decode node dies: the request is parked
            await wait_until(lambda: h.router.parked, what="parked")
            assert not task.done()
            await h.add_node(d1)  # a node comes (back): the parked request goes there
            events = await task
            assert text_of(events) == expected["text"] and events[-1] == "[DONE]"
            assert not h.router.parked and not h.router.requests

    run(scenario())


def test_parked_request_fails_after_retry_wait_and_disconnect_unparks(tokenizer):
    async def scenario():
        p0, d0 = cluster(("p0", "prefill", {}), ("d0", "decode", {"token_delay_s": 0.02}))
        async with serving(tokenizer, p0, d0, heartbeat_timeout_s=0.3, retry_wait_s=0.5) as h:
            task = asyncio.create_task(h.stream("/v1/completions", BODY))
            await wait_until(lambda: d0.tasks, what="decoding on d0")
            d0.heartbeating = False
            events = await task
            assert "no ready decode node" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
            assert not h.router.parked and not h.router.requests
            # A client that leaves while its request is parked takes it out of the parking.
            h.router.retry_wait_s = 30
            d0.heartbeating = True
            await wait_until(lambda: "d0" in h.router.registry.nodes and h.router.registry.nodes["d0"].ready,
                             what="d0 back")
            resp = await h.client.post("/v1/completions", json={**BODY, "stream": True})
            await wait_until(lambda: h.router.requests, what="dispatched")
            d0.heartbeating = False
            await wait_until(lambda: h.router.parked, what="parked")
            resp.close()
            await wait_until(lambda: not h.router.parked and not h.router.requests, what="unparked")

    run(scenario())


def test_two_failure_reports_for_one_attempt_retry_it_once(tokenizer):
    async def scenario():
        from pdserve.protocol.messages import Error

        p0, d0, d1 = cluster(("p0", "prefill", {}), ("d0", "decode", {"token_delay_s": 0.05}),
                             ("d1", "decode", {"token_delay_s": 0.05}))
        async with serving(tokenizer, p0, d0, d1) as h:
            task = asyncio.create_task(h.post("/v1/completions", BODY))
            await wait_until(lambda: h.router.requests, what="dispatched")
            (wire_id, req), = h.router.requests.items()
            err = Error(wire_id, req.decode_node_id, "KV transfer failed", retryable=True)
            abort_nodes = h.router.dispatcher.abort_nodes

            async def yielding_abort(*args):  # a send that yields to the loop, as a full queue would
                await asyncio.sleep(0.01)
                await abort_nodes(*args)

            h.router.dispatcher.abort_nodes = yielding_abort
            await asyncio.gather(h.router.handlers.on_error(b"", err), h.router.handlers.on_error(b"", err))
            assert req.attempt == 1 and h.router.metrics.retries._value.get() == 1
            assert (await task)[0] == 200

    run(scenario())
