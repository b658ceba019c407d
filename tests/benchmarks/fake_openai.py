"""A small fake OpenAI server for the benchmark client: streams `max_tokens` known tokens ("t0", "t1",
...) with fixed delays, on its own event loop in a background thread, so both `asyncio.run` in a
test and the CLI's own `asyncio.run` can talk to it.

Tokens are made one every `itl_s`; the first is sent at once, later ones `tokens_per_chunk` to an
SSE chunk (as a server whose detokenizer or step batches them does), with their ids under
`return_token_ids` unless `send_token_ids` is off (a server that only reports usage).

Failure switches, chosen by the prompt so one run can mix good and bad requests:
- a prompt (token ids or text) that starts with `FAIL_HTTP` (id 7 / text "FAIL") gets HTTP 500;
- one that starts with `FAIL_STREAM` (id 8 / text "BREAK") gets one token, then an error event.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web

from pdserve.cli.serve import free_port

MODEL = "fake-model"
FAIL_HTTP, FAIL_STREAM = 7, 8


@dataclass
class FakeOpenAI:
    ttft_s: float = 0.05  # before the first token
    itl_s: float = 0.02  # between tokens
    send_usage: bool = True  # honour stream_options.include_usage
    send_token_ids: bool = True  # honour return_token_ids
    tokens_per_chunk: int = 1  # after the first token, this many tokens per SSE chunk
    bodies: list[dict] = field(default_factory=list)  # every request body received
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        if _starts(prompt, FAIL_HTTP, "FAIL"):
            return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        num_tokens = 1 if _starts(prompt, FAIL_STREAM, "BREAK") else body["max_tokens"]
        pending: list[int] = []
        for i in range(num_tokens):
            await asyncio.sleep(self.ttft_s if i == 0 else self.itl_s)
            pending.append(i)
            last = i == num_tokens - 1
            if i == 0 or last or len(pending) == self.tokens_per_chunk:
                ids = pending if self.send_token_ids and body.get("return_token_ids") else None
                await _send(resp, _chunk(chat, "".join(f"t{t}" for t in pending), ids, "length" if last else None))
                pending = []
        if _starts(prompt, FAIL_STREAM, "BREAK"):
            await _send(resp, {"error": {"message": "node died", "code": 503}})
        elif self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": _prompt_len(prompt), "completion_tokens": num_tokens,
                     "total_tokens": _prompt_len(prompt) + num_tokens}
            await _send(resp, {"choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _starts(prompt, token_id: int, text: str) -> bool:
    return prompt[:1] == [token_id] if isinstance(prompt, list) else prompt.startswith(text)


def _prompt_len(prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _chunk(chat: bool, text: str, token_ids: list[int] | None, finish: str | None) -> dict:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    choice["finish_reason"] = finish
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"choices": [choice]}


async def _send(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")


class ServerThread:
    """Runs a FakeOpenAI on a free port until `stop()`."""

    def __init__(self, fake: FakeOpenAI) -> None:
        self.fake = fake
        fake.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the fake server did not start")

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.fake.app())
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.fake.port).start())
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
