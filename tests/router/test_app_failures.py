"""What goes wrong: no nodes, dead nodes, node errors, garbage on the control socket, clients that
hang up, deadlines. Every path ends with the request forgotten by the router and aborted on the
nodes that still hold it. Where a node dies, these run with NO_RETRY: what the client sees when a
request cannot be re-dispatched (test_failover.py covers the re-dispatch)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from pdserve.protocol.messages import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Abort,
    Heartbeat,
    PrefillRequest,
    Register,
)
from pdserve.router.app import create_app
from tests.router.conftest import run, serving, split_pair, wait_until
from tests.router.fake_node import FakeNode

SLOW = {"prompt": "hi", "max_tokens": 200}
NO_RETRY = {"max_retries": 0, "retry_wait_s": 0.0}


def test_no_nodes_is_503(tokenizer):
    async def scenario():
        async with serving(tokenizer) as h:
            status, body = await h.post("/v1/completions", {"prompt": "hi"})
            assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
            assert body["error"]["code"] == 503 and "prefill" in body["error"]["message"]
            await h.add_node(FakeNode("p0", "prefill"))
            status, body = await h.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
            assert status == 503 and "decode" in body["error"]["message"]
            await h.add_node(FakeNode("late", ready=False), wait_ready=False)
            await wait_until(lambda: "late" in h.router.registry.nodes and h.router.registry.nodes["late"].heartbeat)
            status, _ = await h.post("/v1/completions", {"prompt": "hi"})
            assert status == 503  # registered, not ready: not eligible
            assert not h.router.requests

    run(scenario())


def test_health_follows_registration_and_heartbeats(tokenizer):
    async def scenario():
        async with serving(tokenizer, heartbeat_timeout_s=0.3, **NO_RETRY) as h:
            assert (await h.client.get("/health")).status == 503
            prefill, decode = split_pair(token_delay_s=0.05)
            await h.add_node(prefill)
            assert (await h.client.get("/health")).status == 503  # no decode-capable node yet
            await h.add_node(decode)
            assert (await h.client.get("/health")).status == 200
            task = asyncio.create_task(h.post("/v1/completions", SLOW))
            await wait_until(lambda: decode.tasks, what="decode started")
            decode.heartbeating = False
            status, body = await task  # the decode node died mid-request: the request fails
            assert status == 503 and "d0" in body["error"]["message"]
            assert "d0" not in h.router.registry.nodes and (await h.client.get("/health")).status == 503
            await wait_until(lambda: prefill.aborted_ids, what="abort at the surviving node")
            decode.heartbeating = True  # a dropped node that heartbeats again is asked to register: it is back
            await wait_until(lambda: decode.reregisters and h.router.is_healthy(), what="d0 registered again")
            assert (await h.client.get("/health")).status == 200 and not h.router.requests

    run(scenario())


def test_deregister_fails_in_flight_stream_with_an_error_event(tokenizer):
    async def scenario():
        node = FakeNode("n0", token_delay_s=0.05)
        async with serving(tokenizer, node, **NO_RETRY) as h:
            resp = await h.client.post("/v1/completions", json={**SLOW, "stream": True})
            assert resp.status == 200
            await resp.content.readline()  # the first chunk is out: the stream has started
            await node.deregister()
            body = (await resp.read()).decode()
            assert '"error"' in body and "n0 left" in body and body.endswith("data: [DONE]\n\n")
            assert (await h.client.get("/health")).status == 503 and not h.router.requests

    run(scenario())


def test_node_errors_map_to_503_or_500(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0", fail="out of memory", retryable=True)) as h:
            status, body = await h.post("/v1/completions", {"prompt": "hi"})
            assert status == 503 and "out of memory" in body["error"]["message"]
            h.nodes["n0"].retryable = False
            status, body = await h.post("/v1/completions", {"prompt": "hi", "stream": True})
            assert status == 500 and body["error"]["type"] == "InternalServerError"  # nothing streamed yet

    run(scenario())


def test_decode_error_after_first_token_aborts_the_prefill_node(tokenizer):
    async def scenario():
        prefill, decode = split_pair(fail="kv transfer failed", token_delay_s=0.2)
        async with serving(tokenizer, prefill, decode) as h:
            events = await h.stream("/v1/completions", {"prompt": "hi", "max_tokens": 5})
            assert events[-1] == "[DONE]" and "kv transfer failed" in events[-2]["error"]["message"]
            await wait_until(lambda: prefill.aborted_ids, what="abort at the prefill node")

    run(scenario())


def test_client_disconnect_mid_stream_aborts_both_nodes(tokenizer):
    async def scenario():
        prefill, decode = split_pair(token_delay_s=0.05)
        async with serving(tokenizer, prefill, decode) as h:
            resp = await h.client.post("/v1/completions", json={**SLOW, "stream": True})
            await resp.content.readline()
            await resp.content.readline()
            resp.close()  # hang up
            request_id = prefill.prefills[0].request_id
            for node in (prefill, decode):
                await wait_until(lambda n=node: request_id in n.aborted_ids, what=f"abort at {node.node_id}")
            await wait_until(lambda: not decode.tasks and not h.router.requests, what="request forgotten")
            assert h.router.registry.nodes["p0"].prefill_load == 0

    run(scenario())


def test_disconnect_is_noticed_without_handler_cancellation(tokenizer):
    """With aiohttp's default (handlers not cancelled on hang-up) the waiting handler notices the
    closed transport by itself, even while no token comes."""

    async def scenario():
        node = FakeNode("n0", token_delay_s=0.05)
        async with serving(tokenizer, node) as h:
            runner = web.AppRunner(create_app(h.router), handler_cancellation=False)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
            try:
                async with aiohttp.ClientSession() as session:
                    resp = await session.post(url, json={**SLOW, "stream": True})
                    await resp.content.readline()
                    node.token_delay_s = 10.0  # no more tokens: only the poll can see the hang-up
                    resp.close()
                await wait_until(lambda: node.aborts, what="abort after hang-up")
                assert not h.router.requests
            finally:
                await runner.cleanup()

    run(scenario())


def test_reregistering_with_a_new_pid_fails_the_old_requests(tokenizer):
    async def scenario():
        node = FakeNode("n0", token_delay_s=0.05)
        async with serving(tokenizer, node, **NO_RETRY) as h:
            task = asyncio.create_task(h.post("/v1/completions", SLOW))
            await wait_until(lambda: h.router.requests, what="dispatch")
            await node.send(Register("n0", "both", "tiny", pid=os.getpid() + 1))  # the node restarted
            status, body = await task
            assert status == 503 and "restarted" in body["error"]["message"]
            await node.send(Register("n0", "both", "tiny", pid=os.getpid() + 1))  # a reconnect: nothing to fail
            await wait_until(lambda: h.router.is_healthy(), what="ready again")
            status, _ = await h.post("/v1/completions", {"prompt": "hi"})
            assert status == 200

    run(scenario())


def test_deadline_aborts_the_request(tokenizer):
    async def scenario():
        node = FakeNode("n0", token_delay_s=0.05)
        async with serving(tokenizer, node, request_timeout_s=0.3) as h:
            status, body = await h.post("/v1/completions", SLOW)
            assert status == 504 and "timed out" in body["error"]["message"]
            for _ in range(100):  # the Abort is on its way to the node: give its loop time to read it
                if node.aborts:
                    break
                await asyncio.sleep(0.02)
            assert node.aborts and node.aborts[0].request_id in node.aborted_ids
            assert not h.router.requests

    run(scenario())


def test_garbage_on_the_control_socket_is_dropped(tokenizer):
    bad_frames = [
        [b"\xc1\xff not msgpack"],
        [msgpack.packb([1, 2, 3])],  # not a map
        [msgpack.packb({"type": "no_such_type", "version": PROTOCOL_VERSION})],
        [msgpack.packb({"type": "heartbeat", "version": 999, "node_id": "n0"})],
        [Heartbeat("n0", "many", 1, 0, 0).encode()],  # a field of the wrong type
        [Abort("x").encode(), b"extra frame"],
        [PrefillRequest("r", [1], {}).encode()],  # a message that is not for the router
        [msgpack.packb({"type": "register", "version": PROTOCOL_VERSION, "node_id": "z", "role": "chef",
                        "model": "tiny"})],
        [b"\x00" * (MAX_MESSAGE_BYTES + 1)],  # oversized
    ]

    async def scenario():
        node = FakeNode("n0", script=[70, 71])
        async with serving(tokenizer, node) as h:
            for frames in bad_frames:
                await node.send_raw(*frames)
            stranger = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            stranger.setsockopt(zmq.LINGER, 0)
            stranger.connect(h.router.control_addr)
            await stranger.send(b"hello?")
            await asyncio.sleep(0.2)
            stranger.close()
            await wait_until(lambda: "n0" in h.router.registry.nodes and h.router.registry.nodes["n0"].ready)
            status, body = await h.post("/v1/completions", {"prompt": "hi"})
            assert status == 200 and body["usage"]["completion_tokens"] == 3
            assert set(h.router.registry.nodes) == {"n0"}

    run(scenario())
