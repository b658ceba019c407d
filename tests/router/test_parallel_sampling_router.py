"""n > 1 at the router, against fake nodes (one PrefillRequest with n; choices `{id}#{i}` back):
choices with their index, streamed and not, usage over every choice, validation of n, a
heartbeat listing the request id before the fork, an Error for the request id, and aborts."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.openai_protocol import MAX_N
from tests.router.conftest import run, serving, split_pair, wait_until
from tests.router.fake_node import FakeNode


def texts_by_index(events, key="text"):
    out = {}
    for e in events:
        if isinstance(e, dict):
            for c in e["choices"]:
                piece = c[key] if key == "text" else c["delta"].get("content", "")
                out[c["index"]] = out.get(c["index"], "") + piece
    return out


def test_completions_with_n_choices_streamed_and_not(tokenizer):
    async def scenario():
        async with serving(tokenizer, *split_pair()) as h:
            body = {"prompt": "Hello", "max_tokens": 5, "n": 3, "ignore_eos": True, "return_token_ids": True}
            status, out = await h.post("/v1/completions", body)
            assert status == 200, out
            assert [c["index"] for c in out["choices"]] == [0, 1, 2]
            assert len({tuple(c["token_ids"]) for c in out["choices"]}) == 3  # the fake varies each choice
            assert out["usage"]["completion_tokens"] == 15
            assert out["usage"]["prompt_tokens"] == len(tokenizer.encode("Hello"))
            [prefill] = [n for n in h.nodes.values() if n.role == "prefill"]
            assert [p.request_id for p in prefill.prefills] == [out["id"]]  # one prefill for the three
            events = await h.stream("/v1/completions", {**body, "stream_options": {"include_usage": True}})
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 15
            assert texts_by_index(events) == {c["index"]: c["text"] for c in out["choices"]}
            finishes = [c["index"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]]
            assert sorted(finishes) == [0, 1, 2]
            await wait_until(lambda: not h.router.requests and not h.router.groups, what="router idle")
    run(scenario())


def test_chat_with_n_choices_streams_a_role_chunk_per_choice(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("b0", "both")) as h:
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "n": 2, "ignore_eos": True}
            status, out = await h.post("/v1/chat/completions", body)
            assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1]
            events = await h.stream("/v1/chat/completions", body)
            roles = [c["index"] for e in events[:-1] for c in e["choices"] if c["delta"].get("role")]
            assert sorted(roles) == [0, 1]
            assert texts_by_index(events, "delta") == {c["index"]: c["message"]["content"] for c in out["choices"]}
    run(scenario())


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1, "2", True, 1.5])
def test_bad_n_is_a_400(tokenizer, n):
    async def scenario():
        async with serving(tokenizer, FakeNode("b0", "both")) as h:
            status, out = await h.post("/v1/completions", {"prompt": "Hi", "n": n})
            assert status == 400 and out["error"]["param"] == "n", out
    run(scenario())


def test_the_request_id_listed_before_the_fork_is_not_aborted(tokenizer):
    async def scenario():
        # The prefill fake holds the request under its own id for 0.5 s, heartbeating every 50 ms.
        prefill, decode = split_pair()
        prefill.first_token_delay_s = 0.5
        async with serving(tokenizer, prefill, decode, lost_after_s=0.3) as h:
            status, out = await h.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "n": 2,
                                                           "ignore_eos": True})
            assert status == 200 and len(out["choices"]) == 2, out
            assert out["id"] not in prefill.aborted_ids
    run(scenario())


@pytest.mark.parametrize("retryable", [False, True])
def test_an_error_for_the_request_id_reaches_every_choice(tokenizer, retryable):
    async def scenario():
        bad = FakeNode("bad", "both", fail="out of memory", retryable=retryable)
        async with serving(tokenizer, bad, max_retries=1, retry_wait_s=0) as h:
            status, out = await asyncio.wait_for(h.post("/v1/completions", {"prompt": "Hi", "n": 3}), 10)
            assert status in (500, 503) and "out of memory" in out["error"]["message"], out
            await wait_until(lambda: not h.router.requests and not h.router.groups, what="router idle")
    run(scenario())


def test_a_client_that_leaves_aborts_the_request_and_its_choices(tokenizer):
    async def scenario():
        prefill, decode = split_pair(token_delay_s=0.05)
        async with serving(tokenizer, prefill, decode) as h:
            resp = await h.client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 200, "n": 2,
                                                                "ignore_eos": True, "stream": True})
            await resp.content.readline()
            resp.close()
            await wait_until(lambda: not h.router.requests and not h.router.groups, what="router idle")
            rid = next(iter(prefill.prefills)).request_id
            await wait_until(lambda: {f"{rid}#0", f"{rid}#1"} <= decode.aborted_ids | prefill.aborted_ids,
                             what="the choices aborted")
            await wait_until(lambda: not decode.tasks, what="the decode fake idle")
    run(scenario())


def test_a_re_dispatched_choice_continues_alone_with_its_derived_seed(tokenizer):
    async def scenario():
        prefill, decode = split_pair(token_delay_s=0.05)
        async with serving(tokenizer, prefill, decode, heartbeat_timeout_s=0.5) as h:
            task = asyncio.create_task(h.post("/v1/completions", {"prompt": "Hi", "max_tokens": 20, "n": 2,
                                                                  "seed": 10, "ignore_eos": True}))
            await wait_until(lambda: len(decode.tasks) == 2, what="two choices decoding")
            await decode.close()  # the decode node dies: each choice is re-dispatched alone
            del h.nodes["d0"]
            await h.add_node(FakeNode("b1", "both", cluster=prefill.cluster))
            status, out = await asyncio.wait_for(task, 20)
            assert status == 200 and [len(c["text"]) > 0 for c in out["choices"]] == [True, True], out
            retried = [p for node in (prefill, h.nodes["b1"]) for p in node.prefills if "~" in p.request_id]
            assert sorted(p.request_id.split("~")[0] for p in retried) == [f"{out['id']}#0", f"{out['id']}#1"]
            assert sorted(p.sampling["seed"] for p in retried) == [10, 11]
            assert all(p.sampling["n"] == 1 for p in retried)
    run(scenario())

