"""Fuzzing the HTTP API with request bodies built from the OpenAPI request schemas (router/openapi.py).

An example is one POST: for each field of the endpoint's schema, absent, a value the schema allows
or, in a "junk" example, any JSON value; plus stray keys; or a body that is not a JSON object at
all (random bytes, truncated JSON, NaN, deep nesting). Whatever comes: never a 5xx, every error is
an OpenAI error body, a body the schema allows (within the tiny model's limits: VALID_OVERRIDES)
is a 200 whose stream ends with [DONE], and the request leaves nothing on the router or the nodes.

The router and its fake nodes run on an event loop in a background thread (as in
test_openai_client.py); hypothesis draws the examples in the test's thread.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.router.openapi import CHAT_REQUEST, COMPLETION_REQUEST
from tests.router.conftest import MODEL, serving, wait_until
from tests.router.fake_node import FakeNode

TINY_VOCAB_SIZE = 259  # the tiny tokenizer: 256 bytes and 3 special tokens
MAX_FAKE_TOKENS = 8  # a valid max_tokens may be 2**63-1; the fakes stop here (finish_reason "length")
MAX_TEXT, MAX_ITEMS = 20, 3
ABSENT = object()
ENDPOINTS = {"/v1/completions": COMPLETION_REQUEST, "/v1/chat/completions": CHAT_REQUEST}

_small_max_tokens = st.none() | st.integers(1, MAX_FAKE_TOKENS)
_token_ids = st.lists(st.integers(0, TINY_VOCAB_SIZE - 1), min_size=1, max_size=MAX_TEXT)
_prompt_one = st.text(min_size=1, max_size=MAX_TEXT) | _token_ids
# What the schema cannot know: the model's vocabulary, and (to keep it fast) short outputs.
VALID_OVERRIDES = {"model": st.sampled_from([MODEL, None]),
                   "prompt": _prompt_one | st.lists(_prompt_one, min_size=1, max_size=1),
                   "max_tokens": _small_max_tokens, "max_completion_tokens": _small_max_tokens}

_scalars = (st.none() | st.booleans() | st.integers(-(2**100), 2**100)
            | st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, -(2**63) - 1, 2**80, 1.0, -0.0, 1e308])
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=MAX_TEXT)
            | st.sampled_from(["", "none", "text", "auto", "user", "\ud800", "\u202e", "\x00"]))
JUNK = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=MAX_ITEMS)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=MAX_ITEMS), max_leaves=8)


def from_schema(schema: dict) -> st.SearchStrategy:
    """Values a JSON schema allows (the keywords router/openapi.py uses; an empty schema: anything)."""
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema.get("anyOf", []) + schema.get("oneOf", [])])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum"),
                         exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", MAX_TEXT))
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", MAX_ITEMS), MAX_ITEMS))
    if kind == "object":
        return _objects(schema)
    return JUNK


def _objects(schema: dict) -> st.SearchStrategy:
    if schema.get("maxProperties") == 0:
        return st.just({})
    props, required = schema.get("properties", {}), set(schema.get("required", []))
    fixed = st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                  optional={k: from_schema(v) for k, v in props.items() if k not in required})
    extra = schema.get("additionalProperties")
    if not isinstance(extra, dict):
        return fixed
    more = st.dictionaries(st.text(max_size=8).filter(lambda k: k not in props), from_schema(extra), max_size=2)
    return st.tuples(fixed, more).map(lambda t: {**t[1], **t[0]})


def near_misses(schema: dict) -> list:
    """Values just outside a schema: past its bounds, too short, too long."""
    out = []
    for key, step in (("minimum", -1), ("maximum", 1), ("exclusiveMinimum", 0)):
        if key in schema:
            out.append(schema[key] + step)
    if schema.get("minLength") or schema.get("minItems"):
        out.append("" if schema.get("type") == "string" else [])
    if "maxItems" in schema:
        out.append([0] * (schema["maxItems"] + 1))
    for sub in schema.get("anyOf", []) + schema.get("oneOf", []):
        out += near_misses(sub)
    if "items" in schema:
        out += [[x] for x in near_misses(schema["items"])]
    return out


def junk_for(schema: dict) -> st.SearchStrategy:
    """Anything, a near miss, or a valid container with junk inside (a message whose content is 5)."""
    options = [st.sampled_from(misses)] if (misses := near_misses(schema)) else []
    options += [junk_for(sub) for sub in schema.get("anyOf", []) + schema.get("oneOf", [])
                if "items" in sub or "properties" in sub]
    if "items" in schema:
        options.append(st.lists(junk_for(schema["items"]), min_size=1, max_size=2))
    if props := schema.get("properties"):
        options.append(st.sampled_from(sorted(props)).flatmap(
            lambda k: st.tuples(_objects(schema), junk_for(props[k])).map(lambda t: {**t[0], k: t[1]})))
    return st.one_of(*options, JUNK)


@st.composite
def json_bodies(draw, schema: dict) -> tuple[dict, bool]:
    """A body and whether the schema allows it. Fields are absent or drawn valid, but for at most
    two junk fields, so that a bad value deep in the parser is not hidden behind an earlier one."""
    names = list(schema["properties"])
    num_junk = draw(st.sampled_from([0, 1, 1, 2]))
    junk = draw(st.lists(st.sampled_from(names), min_size=num_junk, max_size=num_junk, unique=True))
    body = {}
    for name, sub in schema["properties"].items():
        if name in junk:
            value = draw(junk_for(sub) | st.just(ABSENT))
        elif name in schema["required"] or draw(st.booleans()):
            value = draw(VALID_OVERRIDES.get(name, from_schema(sub)))
        else:
            continue
        if value is not ABSENT:
            body[name] = value
    if body.get("logprobs") is not True and body.get("top_logprobs") is not None and not junk:
        del body["top_logprobs"]  # a rule across fields (chat): top_logprobs needs logprobs
    strays = st.text(max_size=10).filter(lambda k: k not in schema["properties"])
    body.update(draw(st.dictionaries(strays, JUNK, max_size=2)))  # unknown fields are ignored
    return body, not junk


@st.composite
def requests(draw) -> tuple[str, bytes, bool]:
    """(path, raw body, whether it must succeed)."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    body, valid = draw(json_bodies(ENDPOINTS[path]))
    data = json.dumps(body).encode()
    how = draw(st.sampled_from(["json"] * 6 + ["truncated", "bytes", "other"]))
    if how == "truncated":
        return path, data[: draw(st.integers(0, len(data) - 1))], False
    if how == "bytes":
        return path, draw(st.binary(max_size=64)), False
    if how == "other":
        return path, draw(st.sampled_from([b"", b"null", b"[]", b'"x"', b"{", b"[" * 5000, b"\xff\xfe",
                                           b'{"prompt": "x", "temperature": NaN}', b'{"seed": 1e999}',
                                           json.dumps([body]).encode()])), False
    return path, data, valid


class BoundedNode(FakeNode):
    """A fake node that stops each request after MAX_FAKE_TOKENS tokens, however many it may have."""

    def generate(self, request_id, prompt_token_ids, sampling):
        sampling.max_tokens = min(sampling.max_tokens, MAX_FAKE_TOKENS)
        return super().generate(request_id, prompt_token_ids, sampling)


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def served(tokenizer):
    """(loop thread, harness): a split prefill/decode pair and a colocated node, all BoundedNodes."""
    assert len(tokenizer) == TINY_VOCAB_SIZE
    cluster: dict[str, FakeNode] = {}
    nodes = [BoundedNode("p0", "prefill", cluster=cluster, max_model_len=4096),
             BoundedNode("d0", "decode", cluster=cluster, max_model_len=4096),
             BoundedNode("b0", "both", cluster=cluster, max_model_len=4096)]  # p0 may hand off to b0 too
    runner = LoopThread()
    context = serving(tokenizer, *nodes)
    harness = runner.call(context.__aenter__())
    try:
        yield runner, harness
    finally:
        runner.call(context.__aexit__(None, None, None))
        runner.stop()


async def exchange(h, path: str, data: bytes) -> tuple[int, list | dict]:
    """POST and read the whole answer: the SSE events of a stream, else the JSON body."""
    resp = await h.client.post(path, data=data, headers={"Content-Type": "application/json"})
    if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
        text = (await resp.read()).decode()
        events = [line[len("data: "):] for line in text.split("\n\n") if line]
        return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]
    return resp.status, await resp.json()


def assert_error_body(body) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_fuzzed_requests_get_4xx_or_a_full_answer(served, request):
    runner, h = served
    path, data, valid = request
    status, body = runner.call(exchange(h, path, data))
    assert status < 500, body
    if status == 200:
        if isinstance(body, list):  # a stream
            assert body[-1] == "[DONE]" and not any("error" in e for e in body[:-1]), body
        else:
            assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
    else:
        assert not valid, (status, body)
        assert 400 <= status < 500
        assert_error_body(body)
    nodes = h.nodes.values()
    runner.call(wait_until(lambda: not h.router.requests and not any(n.tasks for n in nodes), what="nothing held"))


def test_router_is_healthy_after_fuzzing(served):
    runner, h = served
    status = runner.call(h.client.get("/health")).status
    assert status == 200 and h.router.is_healthy() and not h.router.requests
