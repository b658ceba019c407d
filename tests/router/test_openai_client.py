"""The official `openai` client against a real aiohttp server on a free port.

The server (router, app and a fake node) runs on an event loop in a background thread; the
synchronous client runs in the test's thread, as a user's program would."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from pdserve.router.app import create_app
from pdserve.router.router import Router
from tests.router.conftest import MODEL, wait_until
from tests.router.fake_node import FakeNode

openai = pytest.importorskip("openai")

SCRIPT_TEXT = "Paris is the capital of France."


class BackgroundServer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.port = 0

    def call(self, coro, timeout_s: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def start(self) -> None:
        self.router = Router(self.tokenizer, MODEL)
        await self.router.start()
        self.runner = web.AppRunner(create_app(self.router), handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        self.node = FakeNode("n0", script=self.tokenizer.encode(SCRIPT_TEXT))
        await self.node.start(self.router.control_addr)
        await wait_until(self.router.is_healthy, what="node ready")

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.node.close()
        await self.router.close()


@pytest.fixture(scope="module")
def client(tokenizer) -> Iterator:
    server = BackgroundServer(tokenizer)
    server.thread.start()
    server.call(server.start())
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=20)
    finally:
        server.call(server.stop())
        server.loop.call_soon_threadsafe(server.loop.stop)
        server.thread.join(5)


def test_models(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completions(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France?", max_tokens=64)
    assert out.choices[0].text == SCRIPT_TEXT and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(SCRIPT_TEXT) + 1
    stream = client.completions.create(model=MODEL, prompt="The capital?", max_tokens=5, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == SCRIPT_TEXT[:5]
    assert chunks[-1].usage.completion_tokens == 5


def test_chat_completions(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, stop=[" of"])
    assert out.choices[0].message.content == "Paris is the capital" and out.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=64, stream=True,
                                            logprobs=True, top_logprobs=1)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == SCRIPT_TEXT
    assert sum(len(c.choices[0].logprobs.content) for c in chunks[1:]) == len(SCRIPT_TEXT) + 1


def test_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="n must be an integer"):
        client.completions.create(model=MODEL, prompt="hi", n=0)


def test_n_choices_streamed_and_not(client):
    """Parallel sampling: n choices with their index; usage over all of them."""
    kw = dict(model=MODEL, max_tokens=4, n=3, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt="hi", **kw)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.text for c in out.choices)
    assert out.usage.completion_tokens == 12
    texts = {}
    for chunk in client.completions.create(prompt="hi", stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in out.choices}
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw)
    contents, usage = {}, None
    for chunk in client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True,
                                                stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
        usage = chunk.usage or usage
    assert contents == {c.index: c.message.content for c in chat.choices}
    assert usage.completion_tokens == chat.usage.completion_tokens == 12
