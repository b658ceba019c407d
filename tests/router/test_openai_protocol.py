"""Request validation: every 4xx class, checked on the parser directly (cheap) and over HTTP; and
the OpenAPI description (router/openapi.py) agrees with the parser and the app's routes."""

from __future__ import annotations

import json

import pytest

from pdserve.router.app import MAX_BODY_BYTES, OPEN_PATHS, create_app
from pdserve.router.openai_protocol import ProtocolError, parse_chat, parse_completion
from pdserve.router.openapi import CHAT_REQUEST, COMPLETION_REQUEST, openapi_spec
from pdserve.router.router import Router
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
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),  # the sampler would turn logits into inf, NaN
    ({"repetition_penalty": 1e39}, "repetition_penalty"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 0}, "n"),  # n > 1 is parallel sampling (test_parallel_sampling_router.py)
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"suffix": "end"}, "suffix"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options"),
    ({"stream_options": [True]}, "stream_options"),
    # nested shapes, huge ints (the wire is int64), non-finite floats, bools posing as ints
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [[[1]]]}, "prompt"),
    ({"prompt": [1.0, 2]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [2**80]}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": "\ud800"}, "prompt"),  # a lone surrogate: valid JSON, refused by the tokenizer
    ({"seed": 2**80}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": True}, "seed"),
    ({"max_tokens": 2**80}, "max_tokens"),
    ({"top_k": 2**80}, "top_k"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("inf")}, "top_p"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"logprobs": -1}, "logprobs"),
    ({"return_token_ids": 1}, "return_token_ids"),
    ({"model": 5}, "model"),
    # unsupported OpenAI parameters away from their neutral value
    ({"n": True}, "n"),
    ({"echo": 0}, "echo"),
    ({"user": 5}, "user"),
    ({"store": True}, "store"),
    ({"metadata": {"k": 1}}, "metadata"),
    ({"service_tier": "flex"}, "service_tier"),
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
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"max_completion_tokens": 2**64}, "max_completion_tokens"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"messages": [None]}, "messages"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "x"}}, "audio"),
])
def test_chat_rejects(tokenizer, body, param):
    with pytest.raises(ProtocolError) as info:
        chat(tokenizer, **body)
    assert info.value.status == 400 and info.value.param == param, info.value.message


def test_unsupported_parameters_are_accepted_at_their_neutral_value(tokenizer):
    common = {"n": 1, "logit_bias": {}, "user": "u", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}
    assert completion(tokenizer, **common, best_of=1, echo=False, suffix="").kind == "completion"
    assert chat(tokenizer, **common, tools=[], functions=[], tool_choice="none", function_call="none",
                parallel_tool_calls=True, response_format={"type": "text"}, modalities=["text"],
                audio=None, prediction=None).kind == "chat"
    nulls = dict.fromkeys(["model", "max_tokens", "temperature", "seed", "stop", "stream", "stream_options",
                           "logprobs", "n", "user", "echo"])
    assert completion(tokenizer, **nulls).sampling.max_tokens == 16  # null means absent


def test_messages_pass_role_content_and_name_only(tokenizer):
    seen = []

    class Spy:
        def __len__(self):
            return len(tokenizer)

        def apply_chat_template(self, messages, **kw):
            seen.extend(messages)
            return [1, 2]

    body = {"messages": [{"role": "user", "content": None, "name": "ann", "tool_calls": [1]}]}
    parse_chat(body, Spy(), MODEL, None)
    assert seen == [{"role": "user", "content": "", "name": "ann"}]


def test_refused_values_are_quoted_short(tokenizer):
    with pytest.raises(ProtocolError) as info:
        completion(tokenizer, suffix="x" * 100_000)
    assert len(info.value.message) < 1000
    with pytest.raises(ProtocolError) as info:
        completion(tokenizer, stop=["x"] * 100_000 + [""])
    assert len(info.value.message) < 1000


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
            status, body = await h.post("/v1/completions", {"prompt": "hi", "n": 0})
            assert status == 400 and body["error"]["param"] == "n"
            status, body = await h.post("/v1/chat/completions", {"model": "other", "messages": MSGS})
            assert status == 404 and body["error"]["type"] == "NotFoundError"
            resp = await h.client.get("/v1/nothing")
            assert resp.status == 404 and (await resp.json())["error"]["code"] == 404
            assert not h.router.requests and not h.nodes["n0"].prefills  # nothing reached a node

    run(scenario())


@pytest.mark.parametrize("data", [
    b'{"prompt": "hi", "temperature": NaN}',  # Python's json takes NaN and Infinity; JSON does not
    b'{"prompt": "hi", "seed": -Infinity}',
    b'{"prompt": "hi", "top_p": 1e999}',  # parses to inf
    b"[" * 100_000 + b"]" * 100_000,  # deeper than Python's stack
    b"\xff\xfe{",
    b"[1, 2]",
    b"",
])
def test_http_bodies_json_refuses(tokenizer, data):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            resp = await h.client.post("/v1/completions", data=data, headers={"Content-Type": "application/json"})
            assert resp.status == 400 and (await resp.json())["error"]["type"] == "BadRequestError"

    run(scenario())


def test_http_oversized_body_bad_encoding_and_wrong_method(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            resp = await h.client.post("/v1/completions", data=b" " * (MAX_BODY_BYTES + 1))
            assert resp.status == 413 and (await resp.json())["error"]["type"] == "RequestEntityTooLargeError"
            resp = await h.client.get("/v1/chat/completions")
            assert resp.status == 405 and resp.headers["Allow"] == "POST"
            assert (await resp.json())["error"]["code"] == 405
        async with serving(tokenizer, FakeNode("n0")) as h:  # a fresh connection: the server drops this one
            resp = await h.client.post("/v1/completions", data=b"not gzip", headers={"Content-Encoding": "gzip"})
            assert resp.status == 400 and "content-encoding" in (await resp.json())["error"]["message"]

    run(scenario())


def test_protocol_error_headers_reach_the_response(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            def overloaded(kind, body):
                raise ProtocolError("busy", status=429, headers={"Retry-After": "1"})

            h.router.parse = overloaded
            resp = await h.client.post("/v1/completions", json={"prompt": "hi"})
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert (await resp.json())["error"] == {"message": "busy", "type": "RateLimitError", "param": None,
                                                   "code": 429}

    run(scenario())


# ---- the OpenAPI description -------------------------------------------------------------------
class Recorder(dict):
    """A request body that records every key the parser looks up, nested ones as
    "stream_options.include_usage" and "messages[].role"."""

    def __init__(self, data: dict, seen: set[str], prefix: str = "") -> None:
        super().__init__({k: _record(v, seen, f"{prefix}{k}") for k, v in data.items()})
        self.seen, self.prefix = seen, prefix

    def get(self, key, default=None):
        self.seen.add(self.prefix + key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.seen.add(self.prefix + key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(self.prefix + key)
        return super().__contains__(key)


def _record(value, seen: set[str], path: str):
    if isinstance(value, dict):
        return Recorder(value, seen, path + ".")
    if isinstance(value, list):
        return [_record(v, seen, path + "[]") for v in value]
    return value


def schema_paths(schema: dict, prefix: str = "") -> set[str]:
    """Every property path a schema describes, in Recorder's notation."""
    out = set()
    for name, sub in schema.get("properties", {}).items():
        out |= {prefix + name} | schema_paths(sub, f"{prefix}{name}.")
    if "items" in schema:
        out |= schema_paths(schema["items"], prefix.rstrip(".") + "[].")
    for sub in schema.get("anyOf", []) + schema.get("oneOf", []):
        out |= schema_paths(sub, prefix)
    return out


def read_keys(parse, tokenizer, *bodies: dict) -> set[str]:
    seen: set[str] = set()
    for body in bodies:
        parse(Recorder(body, seen), tokenizer, MODEL, None)
    return seen


def test_request_schemas_list_what_the_parser_reads(tokenizer):
    usage = {"stream_options": {"include_usage": True}}
    read = read_keys(parse_completion, tokenizer, {"prompt": "hi", **usage})
    assert read <= schema_paths(COMPLETION_REQUEST), read - schema_paths(COMPLETION_REQUEST)
    assert set(COMPLETION_REQUEST["properties"]) <= read  # nothing described is ignored
    message = {"role": "user", "content": [{"type": "text", "text": "x"}], "name": "ann"}
    read = read_keys(parse_chat, tokenizer, {"messages": [message], "logprobs": True, **usage},
                     {"messages": [message], "max_completion_tokens": 3})
    assert read <= schema_paths(CHAT_REQUEST), read - schema_paths(CHAT_REQUEST)
    assert set(CHAT_REQUEST["properties"]) <= read


def test_spec_describes_every_route_and_its_refs_resolve(tokenizer):
    app = create_app(Router(tokenizer, MODEL))
    spec = openapi_spec()
    routes = {(r.resource.canonical, r.method.lower()) for r in app.router.routes() if r.method != "HEAD"}
    described = {(path, method) for path, ops in spec["paths"].items() for method in ops}
    assert routes == described
    text = json.dumps(spec)  # plain JSON
    refs = {ref.split("/")[-1] for ref in _values(json.loads(text), "$ref")}
    assert refs and refs <= set(spec["components"]["schemas"])
    secured = {path for path, ops in openapi_spec(with_api_key=True)["paths"].items()
               if all("security" in op for op in ops.values())}
    assert secured == set(spec["paths"]) - set(OPEN_PATHS)


def _values(node, key: str):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _values(v, key)
    elif isinstance(node, list):
        for v in node:
            yield from _values(v, key)
