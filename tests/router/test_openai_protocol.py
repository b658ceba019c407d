"""Request validation: every 4xx class, checked on the parser directly (cheap) and over HTTP."""

from __future__ import annotations

import pytest

from router.openai_protocol import ProtocolError, parse_chat, parse_completion
from tests.router.conftest import MODEL, run, serving
from tests.router.fake_node import FakeNode

MSGS = [{"role": "user", "content": "hi"}]


def completion(tokenizer, max_model_len=None, **body):
    return parse_completion({"model": MODEL, "prompt": "hello", **body}, tokenizer, MODEL, max_model_len)


def chat(tokenizer, max_model_len=None, **body):
    return parse_chat({"model": MODEL, "messages": MSGS, **body}, tokenizer, MODEL, max_model_len)


def test_completion_defaults_and_prompt_forms(tokenizer):
    p = completion(tokenizer)
    assert p.prompt_token_ids == tokenizer.encode("hello") and p.sampling.max_tokens == 16
    assert not p.stream and not p.include_usage and p.top_logprobs is None
    assert completion(tokenizer, prompt=[1, 2, 3]).prompt_token_ids == [1, 2, 3]
    assert completion(tokenizer, prompt=["hello"]).prompt_token_ids == tokenizer.encode("hello")
    assert completion(tokenizer, prompt=[[4, 5]]).prompt_token_ids == [4, 5]
    p = completion(tokenizer, stop="x", seed=3, temperature=0, logprobs=2, stream=True, n=1, echo=False,
                   best_of=1, logit_bias={}, user="u", stream_options={"include_usage": True}, top_k=0)
    assert p.sampling.stop == ["x"] and p.sampling.seed == 3 and p.sampling.logprobs == 2 and p.include_usage
    assert p.sampling.top_k == -1 and p.top_logprobs == 2


def test_chat_template_and_token_limits(tokenizer):
    p = chat(tokenizer)
    expected = tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert p.prompt_token_ids == expected and p.kind == "chat"
    assert chat(tokenizer, max_model_len=100).sampling.max_tokens == 100 - len(expected)
    assert chat(tokenizer, max_tokens=5).sampling.max_tokens == 5
    assert chat(tokenizer, max_tokens=5, max_completion_tokens=7).sampling.max_tokens == 7
    p = chat(tokenizer, logprobs=True, top_logprobs=3)
    assert p.top_logprobs == 3 and p.sampling.logprobs == 3
    assert chat(tokenizer, logprobs=False).top_logprobs is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert chat(tokenizer, messages=parts).prompt_token_ids == expected
    assert chat(tokenizer, tools=[], tool_choice="none", response_format={"type": "text"}).kind == "chat"


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", "b"]}, "prompt"),  # batches
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [1, 999]}, "prompt"),  # outside the vocabulary
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": "x" * 100}, "prompt"),  # longer than max_model_len (64)
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"suffix": "end"}, "suffix"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options"),
])
def test_completion_rejects(tokenizer, body, param):
    with pytest.raises(ProtocolError) as info:
        completion(tokenizer, max_model_len=64, **body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logprobs": True, "top_logprobs": 30}, "logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"max_completion_tokens": -1}, "max_tokens"),
])
def test_chat_rejects(tokenizer, body, param):
    with pytest.raises(ProtocolError) as info:
        chat(tokenizer, **body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_wrong_model_is_404_and_body_must_be_an_object(tokenizer):
    with pytest.raises(ProtocolError) as info:
        completion(tokenizer, model="gpt-4")
    assert info.value.status == 404
    assert info.value.body() == {"error": {"message": "The model `gpt-4` does not exist.", "type": "NotFoundError",
                                           "param": "model", "code": 404}}
    with pytest.raises(ProtocolError):
        parse_completion([1, 2], tokenizer, MODEL, None)


def test_http_errors_are_openai_bodies(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0", max_model_len=32)) as h:
            resp = await h.client.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"})
            assert resp.status == 400
            body = await resp.json()
            assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
            status, body = await h.post("/v1/completions", {"prompt": "x" * 40})  # > max_model_len from Register
            assert status == 400 and "maximum context length is 32" in body["error"]["message"]
            status, body = await h.post("/v1/completions", {"prompt": "hi", "n": 2})
            assert status == 400 and body["error"]["param"] == "n"
            status, body = await h.post("/v1/chat/completions", {"model": "other", "messages": MSGS})
            assert status == 404 and body["error"]["type"] == "NotFoundError"
            resp = await h.client.get("/v1/nothing")
            assert resp.status == 404 and (await resp.json())["error"]["code"] == 404
            assert not h.router.requests and not h.nodes["n0"].prefills  # nothing reached a node

    run(scenario())
