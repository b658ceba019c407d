"""Validation added for newcomers' mistakes: a max_tokens the context cannot hold (vLLM's 400 and
its clamped default), unknown chat roles, and unknown request fields (logged once per name)."""

from __future__ import annotations

import logging
import uuid

import pytest

from pdserve.router.openai_protocol import (
    CHAT_FIELDS,
    CHAT_ROLES,
    COMPLETION_FIELDS,
    ProtocolError,
    _UnknownFieldLog,
    parse_chat,
    parse_completion,
)
from pdserve.router.openapi import CHAT_REQUEST, COMPLETION_REQUEST
from tests.router.conftest import MODEL, run, serving
from tests.router.fake_node import FakeNode

MSGS = [{"role": "user", "content": "hi"}]
PROMPT = list(range(3, 13))  # 10 token ids
LOGGER = "pdserve.router.openai_protocol"


def completion(tokenizer, max_model_len=None, **body):
    return parse_completion({"model": MODEL, "prompt": PROMPT, **body}, tokenizer, MODEL, max_model_len)


def chat(tokenizer, max_model_len=None, **body):
    return parse_chat({"model": MODEL, "messages": MSGS, **body}, tokenizer, MODEL, max_model_len)


def context_error(max_model_len: int, prompt_len: int, max_tokens: int) -> str:
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.")


# ---- max_tokens and the context ----------------------------------------------------------------
def test_explicit_max_tokens_past_the_context_is_vllms_400(tokenizer):
    assert completion(tokenizer, max_model_len=32, max_tokens=22).sampling.max_tokens == 22  # 10 + 22 = 32 fits
    with pytest.raises(ProtocolError) as info:
        completion(tokenizer, max_model_len=32, max_tokens=23)
    assert info.value.status == 400 and info.value.param == "max_tokens"
    assert info.value.message == context_error(32, 10, 23)
    assert info.value.body()["error"]["type"] == "BadRequestError"


def test_chat_max_tokens_and_max_completion_tokens_past_the_context(tokenizer):
    prompt_len = len(chat(tokenizer).prompt_token_ids)
    for field in ("max_tokens", "max_completion_tokens"):
        assert chat(tokenizer, max_model_len=40, **{field: 40 - prompt_len}).sampling.max_tokens == 40 - prompt_len
        with pytest.raises(ProtocolError) as info:
            chat(tokenizer, max_model_len=40, **{field: 41 - prompt_len})
        assert info.value.param == "max_tokens" and info.value.message == context_error(40, prompt_len, 41 - prompt_len)


def test_default_max_tokens_is_clamped_to_the_room_left(tokenizer):
    assert completion(tokenizer, max_model_len=100).sampling.max_tokens == 16  # OpenAI's default fits
    assert completion(tokenizer, max_model_len=20).sampling.max_tokens == 10  # 16 would not: what is left
    assert completion(tokenizer, max_model_len=11, max_tokens=None).sampling.max_tokens == 1  # null = absent
    prompt_len = len(chat(tokenizer).prompt_token_ids)
    assert chat(tokenizer, max_model_len=50).sampling.max_tokens == 50 - prompt_len  # chat: the whole room


def test_without_max_model_len_nothing_is_checked(tokenizer):
    assert completion(tokenizer, max_tokens=10**9).sampling.max_tokens == 10**9
    assert completion(tokenizer).sampling.max_tokens == 16
    assert chat(tokenizer, max_completion_tokens=10**9).sampling.max_tokens == 10**9
    assert chat(tokenizer).sampling.max_tokens == 1024


def test_http_max_tokens_against_the_nodes_max_model_len(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0", max_model_len=32)) as h:
            status, body = await h.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 23})
            assert status == 400 and body["error"] == {"message": context_error(32, 10, 23),
                                                      "type": "BadRequestError", "param": "max_tokens", "code": 400}
            assert not h.nodes["n0"].prefills  # refused before any node saw it
            prompt = list(range(3, 23))  # 20 tokens: the default 16 is clamped to 12
            status, body = await h.post("/v1/completions", {"prompt": prompt, "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 12
            assert body["choices"][0]["finish_reason"] == "length"
            assert h.nodes["n0"].prefills[-1].sampling["max_tokens"] == 12
        async with serving(tokenizer) as h:  # no node: max_model_len unknown, the 503 as before
            status, body = await h.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6})
            assert status == 503

    run(scenario())


# ---- chat roles --------------------------------------------------------------------------------
@pytest.mark.parametrize("role", CHAT_ROLES)
def test_every_openai_role_is_accepted(tokenizer, role):
    assert chat(tokenizer, messages=[{"role": role, "content": "x"}]).kind == "chat"


@pytest.mark.parametrize("role", ["robot", "User", "", "x" * 10_000])
def test_an_unknown_role_is_a_400(tokenizer, role):
    with pytest.raises(ProtocolError) as info:
        chat(tokenizer, messages=[{"role": "system", "content": "x"}, {"role": role, "content": "y"}])
    assert info.value.status == 400 and info.value.param == "messages"
    assert info.value.message.startswith("messages[1].role must be one of 'system', 'user', 'assistant', 'tool', ")
    assert len(info.value.message) < 1000


def test_http_unknown_role(tokenizer):
    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            status, body = await h.post("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]})
            assert status == 400 and body["error"]["param"] == "messages" and "'bot'" in body["error"]["message"]

    run(scenario())


# ---- unknown fields ----------------------------------------------------------------------------
def test_known_fields_are_the_openapi_schemas():
    assert COMPLETION_FIELDS == set(COMPLETION_REQUEST["properties"])
    assert CHAT_FIELDS == set(CHAT_REQUEST["properties"])


def test_unknown_fields_are_logged_once_per_name_and_the_request_succeeds(tokenizer, caplog):
    a, b = f"zz_{uuid.uuid4().hex}", f"zz_{uuid.uuid4().hex}"  # names no other test logged
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert completion(tokenizer, **{a: 1, b: [2]}).kind == "completion"
        assert completion(tokenizer, **{a: 1}).kind == "completion"
        assert chat(tokenizer, **{b: None}).kind == "chat"
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    message = records[0].getMessage()
    assert "/v1/completions" in message and repr(a) in message and repr(b) in message
    c = f"zz_{uuid.uuid4().hex}"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        caplog.clear()
        assert chat(tokenizer, **{a: 1, c: 1}).kind == "chat"
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "/v1/chat/completions" in record.getMessage() and repr(c) in record.getMessage()
    assert repr(a) not in record.getMessage()


def test_known_fields_are_not_logged(tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        completion(tokenizer, max_tokens=3, temperature=0, seed=1, stop=["x"], user="u", n=1, echo=False,
                   stream=False, stream_options=None, logprobs=None, return_token_ids=True)
        chat(tokenizer, max_completion_tokens=3, logprobs=True, top_logprobs=2, tools=[], tool_choice="none")
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_unknown_field_log_is_bounded(caplog):
    log = _UnknownFieldLog(limit=3)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        log.note("/v1/completions", {"a": 1, "b": 2}, frozenset())
        log.note("/v1/completions", {"c": 1, "d": 2}, frozenset())
        log.note("/v1/completions", {"e": 1}, frozenset())
    messages = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert len(messages) == 2 and log.logged == {"a", "b", "c"}
    assert "'c'" in messages[1] and "'d'" not in messages[1] and "no further" in messages[1]


def test_http_unknown_fields_are_ignored(tokenizer, caplog):
    name = f"zz_{uuid.uuid4().hex}"

    async def scenario():
        async with serving(tokenizer, FakeNode("n0")) as h:
            status, body = await h.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, name: {"x": 1}})
            assert status == 200 and body["usage"]["completion_tokens"] == 2

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(scenario())
    assert any(name in r.getMessage() for r in caplog.records if r.name == LOGGER)
