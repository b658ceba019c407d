"""End to end over HTTP: router + prefill + decode processes, outputs equal transformers' greedy
generate in float32, KV leaves no block behind, first tokens do not wait for the KV transfer."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

from benchmarks.harness.stack import Stack
from tests.e2e.conftest import hf_greedy as _hf_greedy
from tests.e2e.conftest import prompts

# Each test starts a stack of processes (the first also the module's): 8-14 s each measured on
# two busy cores, so twice the 60 s default.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
MAX_TOKENS = 10
# The tiny model needs ~512 bytes of KV a token; the default 2 GB pool per node is memory wasted.
SMALL_POOL = ["--kv-cache-memory-gb", "0.1"]


def hf_greedy(model, prompt_ids, max_tokens=MAX_TOKENS):
    return _hf_greedy(model, prompt_ids, max_tokens)


def completion(stack, prompt, **kw):
    status, body = stack.post("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                  "return_token_ids": True, **kw})
    assert status == 200, body
    return body


def streamed_ids(stack, path, body):
    ids, events = [], []
    for t, event in stack.stream(path, {**body, "return_token_ids": True}):
        events.append((t, event))
        for choice in event["choices"]:
            ids += choice.get("token_ids", [])
    return ids, events


@pytest.fixture(scope="module")
def stack(model_dir):
    s = Stack(str(model_dir[0]), extra=SMALL_POOL)
    yield s
    s.close()


def assert_idle(stack):
    for status in stack.wait_idle():
        assert status["num_used_blocks"] == 0, status
        assert status["num_running"] == 0 and status["num_waiting"] == 0, status
        assert status.get("num_leases", 0) == 0 and status.get("num_receiving", 0) == 0, status


def test_completions_equal_transformers(stack, model_dir):
    _, model, _ = model_dir
    for p in prompts(6, seed=1):
        want = hf_greedy(model, p)
        assert completion(stack, p)["choices"][0]["token_ids"] == want
        ids, _ = streamed_ids(stack, "/v1/completions", {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
        assert ids == want
    assert_idle(stack)


def test_text_prompt_and_chat_equal_transformers(stack, model_dir):
    _, model, tok = model_dir
    text_ids = tok.encode("The quick brown fox")
    body = completion(stack, "The quick brown fox")
    assert body["choices"][0]["token_ids"] == hf_greedy(model, text_ids)
    assert body["usage"]["prompt_tokens"] == len(text_ids)
    messages = [{"role": "user", "content": "Hello there!"}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    want = hf_greedy(model, list(chat_ids))
    status, body = stack.post("/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS,
                                                       "temperature": 0, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_ids"] == want
    assert body["choices"][0]["message"]["content"] == tok.decode(want, skip_special_tokens=True)
    ids, events = streamed_ids(stack, "/v1/chat/completions",
                               {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert ids == want and events[0][1]["choices"][0]["delta"]["role"] == "assistant"


def test_openai_client_both_endpoints(stack, model_dir):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="none")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hi", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    pieces = [c.choices[0].text for c in client.completions.create(model=model, prompt="Hi", max_tokens=5,
                                                                     temperature=0, stream=True) if c.choices]
    assert "".join(pieces) == out.choices[0].text
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Yo"}], max_tokens=5,
                                          temperature=0)
    streamed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Yo"}],
                                              max_tokens=5, temperature=0, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


def leave_mid_stream(stack, body: dict, num_events: int) -> None:
    """Stream a completion of `body` and hang up after `num_events` events (a client that goes away)."""
    req = urllib.request.Request(stack.url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        seen = 0
        for raw in r:
            if raw.startswith(b"data: {"):
                seen += 1
                if seen == num_events:
                    break


def test_client_disconnect_aborts_on_both_nodes(stack):
    leave_mid_stream(stack, {"prompt": list(range(3, 60)), "max_tokens": 400, "temperature": 0, "ignore_eos": True},
                     num_events=3)
    assert_idle(stack)


def test_first_token_arrives_before_the_kv_transfer_ends(model_dir):
    # The decode node waits 1.5 s before pulling each request's KV (a slow network, simulated);
    # the first token must reach the client in the meantime.
    s = Stack(str(model_dir[0]), decode_args="--kv-pull-delay-s 1.5", extra=SMALL_POOL)
    try:
        ids, events = streamed_ids(s, "/v1/completions", {"prompt": list(range(3, 100)), "max_tokens": 4, "ignore_eos": True,
                                                          "temperature": 0})
        first_token_at = next(t for t, e in events if e["choices"] and e["choices"][0].get("token_ids"))
        request_id = events[0][1]["id"]
        decode = next(st for st in s.node_status() if st["role"] == "decode")
        prefill = next(st for st in s.node_status() if st["role"] == "prefill")
        kv = next(t for t in decode["timings"] if t["request_id"] == request_id)
        pre = next(t for t in prefill["timings"] if t["request_id"] == request_id)
        assert pre["first_token"] < first_token_at < kv["kv_done"]
        assert len(ids) == 4
        assert_idle(s)
    finally:
        s.close()


def test_two_by_two_serves_64_concurrent_streams(model_dir):
    _, model, _ = model_dir
    s = Stack(str(model_dir[0]), num_prefill=2, num_decode=2, extra=SMALL_POOL)
    try:
        ps = prompts(64, seed=7, lo=1, hi=300)
        want = [hf_greedy(model, p) for p in ps]
        got: dict[int, list[int]] = {}
        errors = []

        def worker(i):
            try:
                got[i], _ = streamed_ids(s, "/v1/completions", {"prompt": ps[i], "max_tokens": MAX_TOKENS,
                                                                "temperature": 0})
            except Exception as e:  # collected, asserted below
                errors.append((i, repr(e)))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors
        assert [got[i] for i in range(64)] == want
        status = s.wait_idle()
        for role in ("prefill", "decode"):
            used = [st for st in status if st["role"] == role and st["timings"]]
            assert len(used) == 2, f"both {role} nodes should have served requests"
        assert_idle(s)
    finally:
        s.close()


def test_colocated_mode_equals_transformers(model_dir):
    _, model, _ = model_dir
    s = Stack(str(model_dir[0]), colocated=True, num_nodes=1, extra=SMALL_POOL)
    try:
        for p in prompts(3, seed=3):
            assert completion(s, p)["choices"][0]["token_ids"] == hf_greedy(model, p)
        assert_idle(s)
    finally:
        s.close()


def test_garbage_to_node_sockets_is_dropped(stack, model_dir):
    import zmq

    _, model, _ = model_dir
    ctx = zmq.Context.instance()
    decode = next(n for n in stack.nodes() if n["role"] == "decode")
    for junk in (b"", b"\x00" * 100, b"\x93\x01\x02\x03", b'{"type": "kv_ready"}'):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 5000)  # a send that cannot go out fails the test, not hangs it
        sock.connect(decode["kv_addr"])
        sock.send_multipart([junk, b"more"])
        sock.send(junk)
        time.sleep(0.05)
        sock.close()
    p = prompts(1, seed=11)[0]
    assert completion(stack, p)["choices"][0]["token_ids"] == hf_greedy(model, p)
    assert_idle(stack)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the stack alone may take 600 s to load the default model on a busy machine
def test_default_model_over_http_equals_transformers():
    """The default model, text prompts and chat, streamed and not: greedy float32 outputs equal
    transformers' generate token for token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.loader import resolve_model

    path = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    s = Stack("smollm2", timeout=600)
    try:
        for text in ("The capital of France is", "def fibonacci(n):"):
            want = hf_greedy(model, tok.encode(text), max_tokens=24)
            body = completion(s, text, max_tokens=24)
            assert body["choices"][0]["token_ids"] == want
            assert body["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
            ids, _ = streamed_ids(s, "/v1/completions", {"prompt": text, "max_tokens": 24, "temperature": 0})
            assert ids == want
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
        want = hf_greedy(model, chat_ids, max_tokens=32)
        status, body = s.post("/v1/chat/completions", {"messages": messages, "max_tokens": 32, "temperature": 0,
                                                       "return_token_ids": True})
        assert status == 200 and body["choices"][0]["token_ids"] == want
        assert "Paris" in body["choices"][0]["message"]["content"]
        ids, _ = streamed_ids(s, "/v1/chat/completions", {"messages": messages, "max_tokens": 32, "temperature": 0})
        assert ids == want
        assert_idle(s)
    finally:
        s.close()
