"""One streaming request to an OpenAI-compatible endpoint, measured into a `RequestRecord`.

Timing follows vLLM's client: TTFT is the time to the first SSE chunk that carries output (text,
or token ids under vLLM's `return_token_ids`); each later output chunk adds one inter-token gap.
A chunk can hold several tokens, so the output length comes from the final usage chunk
(`stream_options.include_usage`) when the server sends one, else from the token ids seen, else
from the number of output chunks. Whatever goes wrong ends up in `record.error`, never raised.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import aiohttp

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.request_record import RequestRecord


@dataclass
class EndpointConfig:
    api_url: str  # base URL + endpoint path
    model: str
    ignore_eos: bool = False
    temperature: float = 0.0
    return_token_ids: bool = False  # vLLM's extension; off for servers that reject unknown fields
    extra_body: dict = field(default_factory=dict)  # merged into every request body

    @property
    def is_chat(self) -> bool:
        return self.api_url.rstrip("/").endswith("/chat/completions")


class StreamError(RuntimeError):
    """The server reported an error inside the stream (after the 200 status)."""


def build_body(cfg: EndpointConfig, sample: SampleRequest) -> dict:
    body: dict = {"model": cfg.model, "max_tokens": sample.output_len, "temperature": cfg.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if cfg.is_chat:
        text = sample.prompt if isinstance(sample.prompt, str) else None
        if text is None:
            raise ValueError("the chat endpoint needs text prompts, not token ids")
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = sample.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.return_token_ids:
        body["return_token_ids"] = True
    return {**body, **cfg.extra_body}


def auth_headers() -> dict:
    key = os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


class _StreamState:
    """What the chunks of one stream have shown so far."""

    def __init__(self, start: float) -> None:
        self.start, self.first, self.last = start, None, None
        self.itl: list[float] = []
        self.num_ids = self.num_chunks = 0
        self.usage: dict | None = None
        self.text: list[str] = []

    def on_event(self, event: dict, now: float) -> None:
        if event.get("error") and not event.get("choices"):
            err = event["error"]
            raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            text = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or ""
            ids = choice.get("token_ids") or []
            if text or ids:
                self._on_output(now)
                self.text.append(text)
                self.num_ids += len(ids)
            elif choice.get("finish_reason") and self.first is None:
                self.first = self.last = now  # finished without output (e.g. EOS first): TTFT is here

    def _on_output(self, now: float) -> None:
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.num_chunks += 1

    def output_len(self) -> int:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.num_ids or self.num_chunks


async def _read_events(resp: aiohttp.ClientResponse):
    """Yields (arrival time, event dict) per SSE `data:` line until [DONE] or the end of the body."""
    buffer = b""
    async for piece in resp.content.iter_any():
        now = time.perf_counter()
        buffer += piece
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield now, json.loads(data)


async def send_request(session: aiohttp.ClientSession, cfg: EndpointConfig, sample: SampleRequest,
                       request_id: int, clock_zero: float = 0.0) -> RequestRecord:
    record = RequestRecord(request_id, sample.prompt_len, sample.output_len)
    start = time.perf_counter()
    record.start_s = start - clock_zero
    state = _StreamState(start)
    try:
        async with session.post(cfg.api_url, json=build_body(cfg, sample), headers=auth_headers()) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return record
            async for now, event in _read_events(resp):
                state.on_event(event, now)
    except Exception as e:  # anything one request hits is that request's failure, not the run's
        record.error = f"{type(e).__name__}: {e}"[:500]
        return record
    return _finish(record, state, time.perf_counter())


def _finish(record: RequestRecord, state: _StreamState, end: float) -> RequestRecord:
    if state.first is None:
        record.error = "the stream ended without output"
        return record
    record.success = True
    record.ttft_s, record.itl_s, record.e2el_s = state.first - state.start, state.itl, end - state.start
    record.output_len = state.output_len()
    record.generated_text = "".join(state.text)
    if state.usage and isinstance(state.usage.get("prompt_tokens"), int):
        record.prompt_len = state.usage["prompt_tokens"]  # the server's count beats our estimate
    return record
