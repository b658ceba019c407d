"""One streaming request to an OpenAI-compatible endpoint, measured into a `RequestRecord`.

TTFT is the time to the first SSE chunk that carries output (text, or token ids under vLLM's
`return_token_ids`). A chunk can carry several tokens (a node's step can emit them together, the
detokenizer holds back an incomplete character, the network coalesces writes), so ITL counts tokens,
not chunks: a later chunk holding k tokens arrived `gap` after the previous one and adds k samples of
gap / k (as SGLang's bench_serving does). k is the chunk's `token_ids` when the server returns them
(pdserve and vLLM do; the default asks for them). Without ids, the final usage chunk
(`stream_options.include_usage`) gives the total, and the tokens beyond one per chunk are shared out
over the gaps (`spread_tokens`). Either way the mean ITL is the decode time over the decoded tokens, the
TPOT a client sees, not a multiple of it. The output length is usage's completion_tokens, else the ids
seen, else the number of output chunks. The prompt tokens the server served from its prefix cache are
usage's `prompt_tokens_details.cached_tokens` (OpenAI's field), None when the server does not say. Whatever goes wrong ends up in `record.error`, never raised.
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
    return_token_ids: bool = True  # vLLM's extension, exact tokens per chunk; off for servers that reject it
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
        if sample.messages is not None:
            body["messages"] = sample.messages
        else:
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
        self.start, self.first = start, None
        self.chunks: list[tuple[float, int]] = []  # (arrival, token ids in it) per output chunk
        self.usage: dict | None = None
        self.text: list[str] = []
        self.ids: list[int] = []  # the output token ids the chunks carried

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
                self._on_output(now, len(ids))
                self.ids += ids
                self.text.append(text)
            elif choice.get("finish_reason") and self.first is None:
                self.first = now  # finished without output (e.g. EOS first): TTFT is here

    def _on_output(self, now: float, num_ids: int) -> None:
        if self.first is None:
            self.first = now
        self.chunks.append((now, num_ids))

    @property
    def num_ids(self) -> int:
        return sum(k for _, k in self.chunks)

    def output_len(self) -> int:
        if self.usage and isinstance(self.usage.get("completion_tokens"), int):
            return self.usage["completion_tokens"]
        return self.num_ids or len(self.chunks)

    def itl(self) -> list[float]:
        """One sample per token after the first chunk: a gap spread over the tokens it brought."""
        times = [t for t, _ in self.chunks]
        gaps = [b - a for a, b in zip(times, times[1:])]
        if self.num_ids:  # the server sent ids: a chunk without ids adds its gap to the next one's
            counts = [k for _, k in self.chunks[1:]]
        else:
            counts = spread_tokens(gaps, self.output_len() - 1)
        samples, carried = [], 0.0
        for gap, k in zip(gaps, counts):
            if k == 0:
                carried += gap
                continue
            samples += [(carried + gap) / k] * k
            carried = 0.0
        return samples


def spread_tokens(gaps: list[float], num_tokens: int) -> list[int]:
    """Tokens per gap when only the total is known: at least one each, the rest shared out evenly,
    and what does not divide evenly to the longest gaps (a chunk that took longer had more time to
    gather tokens)."""
    counts = [1] * len(gaps)
    extra = num_tokens - len(gaps)
    if extra <= 0 or not gaps:
        return counts
    base, rem = divmod(extra, len(gaps))
    longest = sorted(range(len(gaps)), key=lambda i: -gaps[i])
    for rank, i in enumerate(longest):
        counts[i] += base + (rank < rem)
    return counts


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
    if isinstance(sample.prompt, list) and sample.messages is None:
        record.prompt_ids = sample.prompt
    start = time.perf_counter()
    record.start_s = start - clock_zero
    state = _StreamState(start)
    try:
        async with session.post(cfg.api_url, json=build_body(cfg, sample), headers=auth_headers()) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                if resp.status == 400 and cfg.return_token_ids and "return_token_ids" in record.error:
                    record.error += " (this server refuses return_token_ids: pass --no-return-token-ids)"
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
    record.ttft_s, record.itl_s, record.e2el_s = state.first - state.start, state.itl(), end - state.start
    record.output_len = state.output_len()
    record.generated_text = "".join(state.text)
    record.output_ids = state.ids
    if state.usage and isinstance(state.usage.get("prompt_tokens"), int):
        record.prompt_len = state.usage["prompt_tokens"]  # the server's count beats our estimate
    record.cached_tokens = cached_tokens(state.usage)
    return record


def cached_tokens(usage: dict | None) -> int | None:
    """OpenAI's `usage.prompt_tokens_details.cached_tokens`; None (unknown, not 0) when not reported."""
    details = (usage or {}).get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
