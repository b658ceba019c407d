"""End to end through HTTP, the router and fake nodes: the answers, streamed or not."""

from __future__ import annotations

from tests.router.conftest import MODEL, run, serving, split_pair
from tests.router.fake_node import FakeNode, next_token

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def expected_ids(prompt_ids: list[int], n: int) -> list[int]:
    out, last = [], prompt_ids[-1]
    for _ in range(n):
        last = next_token(last, 256)
        out.append(last)
    return out


def stream_text(events: list, chat: bool = False) -> str:
    key = (lambda c: c["delta"].get("content", "")) if chat else (lambda c: c["text"])
    return "".join(key(c) for e in events if isinstance(e, dict) for c in e.get("choices", []))


def test_completion_plain_and_streamed_agree(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            status, body = await h.post("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 7})
            assert status == 200
            assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL
            (choice,) = body["choices"]
            assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
            prompt_ids = tokenizer.encode("hello")
            assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
            events = await h.stream("/v1/completions", {"prompt": "hello", "max_tokens": 7})
            assert events[-1] == "[DONE]" and "usage" not in events[0]
            assert stream_text(events) == choice["text"]
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert h.nodes["n0"].prefills[0].prompt_token_ids == prompt_ids
            assert h.nodes["n0"].prefills[0].decode_node_id == ""  # a lone "both" node decodes itself
            assert not h.router.requests

    run(scenario())


def test_streamed_usage_chunk(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            events = await h.stream("/v1/completions", {"prompt": [5, 6], "max_tokens": 3,
                                                        "stream_options": {"include_usage": True}})
            *chunks, usage, done = events
            assert done == "[DONE]" and usage["choices"] == []
            assert usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                                      "prompt_tokens_details": {"cached_tokens": 0}}
            assert all(c["usage"] is None for c in chunks)

    run(scenario())


def test_chat_plain_and_streamed(tokenizer):
    script = tokenizer.encode("Bonjour à tous")

    async def scenario():
        async with serving(tokenizer, FakeNode("n0", script=script)) as h:
            status, body = await h.post("/v1/chat/completions", {**CHAT, "max_tokens": 50})
            assert status == 200 and body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
            (choice,) = body["choices"]
            assert choice["message"] == {"role": "assistant", "content": "Bonjour à tous"}
            assert choice["finish_reason"] == "stop"  # the fake's EOS after the script
            assert body["usage"]["completion_tokens"] == len(script) + 1
            events = await h.stream("/v1/chat/completions", {**CHAT, "max_completion_tokens": 50,
                                                             "stream_options": {"include_usage": True}})
            assert events[0]["object"] == "chat.completion.chunk"
            assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert stream_text(events, chat=True) == "Bonjour à tous"
            assert events[-3]["choices"][0]["finish_reason"] == "stop"
            assert events[-2]["usage"]["completion_tokens"] == len(script) + 1

    run(scenario())


def test_split_prefill_decode_with_out_of_order_tokens(tokenizer):
    async def scenario():
        prefill, decode = split_pair(reverse_order=True)
        prefill.first_token_delay_s = 0.2  # every decode token arrives before the first token
        async with serving(tokenizer, prefill, decode) as h:
            prompt = tokenizer.encode("The sky is")
            status, body = await h.post("/v1/completions", {"prompt": prompt, "max_tokens": 12})
            assert status == 200 and body["usage"]["completion_tokens"] == 12
            req = prefill.prefills[0]
            assert req.decode_node_id == "d0" and req.decode_kv_addr == "inproc://d0-kv"
            events = await h.stream("/v1/completions", {"prompt": prompt, "max_tokens": 12})
            assert stream_text(events) == body["choices"][0]["text"]
            full = tokenizer.decode(expected_ids(prompt, 12))
            assert body["choices"][0]["text"] == full

    run(scenario())


def test_first_token_can_finish_the_request(tokenizer):
    async def scenario():
        prefill, decode = split_pair()
        async with serving(tokenizer, prefill, decode) as h:
            status, body = await h.post("/v1/completions", {"prompt": [40], "max_tokens": 1})
            assert status == 200 and body["usage"]["completion_tokens"] == 1
            assert body["choices"][0]["finish_reason"] == "length"

    run(scenario())


def test_stop_string_across_tokens_aborts_both_nodes(tokenizer):
    script = tokenizer.encode("Hello world, and then much more text that never ends")

    async def scenario():
        prefill, decode = split_pair(script=script, token_delay_s=0.02)
        prefill.script = script
        async with serving(tokenizer, prefill, decode) as h:
            status, body = await h.post("/v1/completions", {"prompt": "x", "max_tokens": 60, "stop": ["lo w", "zzz"]})
            assert status == 200
            assert body["choices"][0] == {"index": 0, "text": "Hel", "logprobs": None, "finish_reason": "stop"}
            request_id = prefill.prefills[0].request_id
            events = await h.stream("/v1/completions", {"prompt": "x", "max_tokens": 60, "stop": "d, a"})
            assert stream_text(events) == "Hello worl" and events[-2]["choices"][0]["finish_reason"] == "stop"
            for node in (prefill, decode):
                await _wait_aborted(node, request_id)
                await _wait_aborted(node, prefill.prefills[1].request_id)

    run(scenario())


async def _wait_aborted(node: FakeNode, request_id: str) -> None:
    from tests.router.conftest import wait_until

    await wait_until(lambda: request_id in node.aborted_ids, what=f"Abort of {request_id} at {node.node_id}")


def test_completion_logprobs_shape(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            status, body = await h.post("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 2})
            lp = body["choices"][0]["logprobs"]
            assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
            assert lp["token_logprobs"] == [-0.5] * 4
            for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
                # top-2 plus the sampled token; fewer when byte tokens decode to the same "\ufffd" key
                assert 1 <= len(top) <= 3 and token in top
            assert lp["text_offset"][0] == 0
            events = await h.stream("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logprobs": 0})
            tokens = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["tokens"]]
            assert tokens == lp["tokens"]

    run(scenario())


def test_chat_logprobs_shape(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            body = {**CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
            status, out = await h.post("/v1/chat/completions", body)
            content = out["choices"][0]["logprobs"]["content"]
            assert len(content) == 3
            for entry in content:
                assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["logprob"] == -0.5
                assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == -0.5
                assert entry["bytes"] == list(entry["token"].encode())
            events = await h.stream("/v1/chat/completions", body)
            streamed = [x for e in events[1:-1] for x in e["choices"][0]["logprobs"]["content"]]
            assert streamed == content

    run(scenario())


def test_models_endpoint(tokenizer):
    async def scenario():
        async with serving(tokenizer) as h:
            resp = await h.client.get("/v1/models")
            body = await resp.json()
            assert resp.status == 200 and body["object"] == "list"
            assert [m["id"] for m in body["data"]] == [MODEL] and body["data"][0]["object"] == "model"

    run(scenario())
