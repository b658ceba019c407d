"""Parallel sampling (n > 1) end to end over HTTP: router + prefill + decode processes on a tiny
random model. Greedy choices equal transformers; seeded choice i equals an n = 1 request seeded
with seed + i; the official `openai` client gets n choices, streamed and not; usage counts every
choice; a client that leaves mid-stream leaves no block, lease or request behind."""

from __future__ import annotations

import pytest

from benchmarks.harness.stack import Stack
from tests.e2e.conftest import hf_greedy, prompts
from tests.e2e.test_disaggregated import SMALL_POOL, assert_idle, leave_mid_stream

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def stack(model_dir):
    s = Stack(str(model_dir[0]), extra=SMALL_POOL)
    yield s
    s.close()


def by_index(choices: list[dict]) -> dict[int, dict]:
    return {c["index"]: c for c in choices}


def test_greedy_choices_equal_transformers_streamed_and_not(stack, model_dir):
    _, model, _ = model_dir
    for p in prompts(3, seed=5, lo=20, hi=120):
        want = hf_greedy(model, p, MAX_TOKENS)
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "n": 3, "return_token_ids": True}
        status, out = stack.post("/v1/completions", body)
        assert status == 200, out
        choices = by_index(out["choices"])
        assert sorted(choices) == [0, 1, 2]
        assert all(c["token_ids"] == want for c in choices.values())
        assert out["usage"]["prompt_tokens"] == len(p)
        assert out["usage"]["completion_tokens"] == 3 * len(want)
        streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finished = {}
        for _, event in stack.stream("/v1/completions", {**body, "stream": True}):
            for c in event["choices"]:
                streamed[c["index"]] += c.get("token_ids", [])
                if c["finish_reason"] is not None:
                    finished[c["index"]] = c["finish_reason"]
        assert streamed == {0: want, 1: want, 2: want} and sorted(finished) == [0, 1, 2]
    assert_idle(stack)


def test_seeded_choice_i_equals_a_single_request_with_seed_plus_i(stack):
    p = prompts(1, seed=8, lo=40, hi=60)[0]
    body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 1.0, "ignore_eos": True, "return_token_ids": True}
    status, out = stack.post("/v1/completions", {**body, "n": 3, "seed": 77})
    assert status == 200, out
    got = {c["index"]: c["token_ids"] for c in out["choices"]}
    for i in range(3):
        status, alone = stack.post("/v1/completions", {**body, "seed": 77 + i})
        assert alone["choices"][0]["token_ids"] == got[i], i
    assert len({tuple(t) for t in got.values()}) > 1
    assert_idle(stack)


def test_openai_client_gets_n_choices(stack):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    kw = dict(model=model, max_tokens=6, temperature=0.8, seed=3, n=3, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt="Hello", **kw)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 3 * 6  # every choice counts
    texts = {i: "" for i in range(3)}
    for chunk in client.completions.create(prompt="Hello", stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in out.choices}
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Yo"}], **kw)
    assert sorted(c.index for c in chat.choices) == [0, 1, 2]
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "Yo"}], stream=True,
                                            stream_options={"include_usage": True}, **kw)
    contents, usage = {i: "" for i in range(3)}, None
    for chunk in stream:
        for c in chunk.choices:
            contents[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert contents == {c.index: c.message.content for c in chat.choices}
    assert usage.completion_tokens == chat.usage.completion_tokens
    assert usage.prompt_tokens == chat.usage.prompt_tokens
    assert_idle(stack)


def test_client_disconnect_aborts_every_choice(stack):
    leave_mid_stream(stack, {"prompt": list(range(3, 60)), "max_tokens": 400, "temperature": 1.0, "ignore_eos": True,
                             "n": 4}, num_events=12)
    assert_idle(stack)
