"""OpenAI response bodies and stream chunks for /v1/completions and /v1/chat/completions.

Both formats share one interface (`full`, `chunks`, `usage_chunk`), so the HTTP side streams or
collects a request the same way whatever the endpoint. Logprobs follow each endpoint's shape:
completions' legacy columns (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and chat's
list of `{token, logprob, bytes, top_logprobs}`.

A stream's events are built by `sse`, not by `json.dumps` of each chunk: a chunk's envelope is the
same for the whole stream, so it is rendered once, and each event only escapes its text. The bytes
are exactly `json.dumps(chunk, ensure_ascii=False)` of what `chunks` returns (tests/router check
it); the logprobs part, when asked for, still goes through json.dumps.
"""

from __future__ import annotations

import json
import time
import uuid
from json.encoder import encode_basestring as _json_str  # what json.dumps(ensure_ascii=False) uses

from pdserve.router.request_state import Delta, TokenLogprob


def new_request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens`: prompt tokens the node that
    prefilled the request found in its prefix cache (as vLLM reports them)."""
    out = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
           "total_tokens": num_prompt_tokens + num_completion_tokens}
    if num_cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": num_cached_tokens}
    return out


class _Format:
    object_full = ""
    object_chunk = ""

    def __init__(self, request_id: str, model: str, *, include_usage: bool = False,
                 top_logprobs: int | None = None, return_token_ids: bool = False) -> None:
        self.return_token_ids = return_token_ids
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.include_usage = include_usage
        self.top_logprobs = top_logprobs  # None: logprobs were not asked for
        self._sse_head: tuple[str, str] | None = None  # (before a choice's fields, after them)

    def _envelope(self, obj: str, choices: list[dict], **extra) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def _chunk(self, choice: dict, token_ids: list[int] | None = None) -> dict:
        if self.return_token_ids and token_ids is not None:
            choice["token_ids"] = token_ids
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope(self.object_chunk, [choice], **extra)

    def _has_ids(self, delta: Delta) -> bool:
        return self.return_token_ids and bool(delta.token_ids)

    def usage_chunk(self, usage_: dict) -> dict:
        return self._envelope(self.object_chunk, [], usage=usage_)

    def _head(self) -> tuple[str, str]:
        """An event's text before its one choice's index and after that choice's fields: the
        envelope of `_chunk` as json.dumps writes it."""
        if self._sse_head is None:
            before = (f'data: {{"id": {_json_str(self.request_id)}, "object": {_json_str(self.object_chunk)}, '
                      f'"created": {json.dumps(self.created)}, "model": {_json_str(self.model)}, '
                      f'"choices": [{{"index": ')
            after = '}], "usage": null}\n\n' if self.include_usage else '}]}\n\n'
            self._sse_head = before, after
        return self._sse_head

    def _tail_fields(self, delta: Delta, token_ids: bool = True) -> str:
        """`"logprobs": ..., "finish_reason": ...[, "token_ids": [...]]` of a chunk."""
        logprobs = "null" if self.top_logprobs is None else json.dumps(self._logprobs(delta.logprobs), ensure_ascii=False)
        finish = "null" if delta.finish_reason is None else _json_str(delta.finish_reason)
        out = f'"logprobs": {logprobs}, "finish_reason": {finish}'
        if token_ids and self.return_token_ids:
            out += ', "token_ids": [' + ", ".join(map(str, delta.token_ids)) + "]"
        return out


class CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def full(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob], usage_: dict) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return self._envelope(self.object_full, [choice], usage=usage_)

    def chunks(self, delta: Delta, first: bool) -> list[dict]:
        if not (delta.text or delta.logprobs or delta.finish_reason or self._has_ids(delta)):
            return []
        return [self._chunk({"index": 0, "text": delta.text, "logprobs": self._logprobs(delta.logprobs),
                             "finish_reason": delta.finish_reason}, delta.token_ids)]

    def sse(self, delta: Delta, first: bool, index: int = 0) -> bytes:
        """`chunks(delta, first)` as SSE events, for choice `index` (module docstring)."""
        if not (delta.text or delta.logprobs or delta.finish_reason or self._has_ids(delta)):
            return b""
        before, after = self._head()
        return f'{before}{index}, "text": {_json_str(delta.text)}, {self._tail_fields(delta)}{after}'.encode()

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.top_logprobs is None:
            return None
        return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [dict(e.top) for e in entries], "text_offset": [e.text_offset for e in entries]}


class ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def full(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob], usage_: dict) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
        return self._envelope(self.object_full, [choice], usage=usage_)

    def chunks(self, delta: Delta, first: bool) -> list[dict]:
        out = []
        if first:  # OpenAI's first chunk carries the role alone
            out.append(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}))
        if delta.text or delta.logprobs or delta.finish_reason or self._has_ids(delta):
            body = {"content": delta.text} if delta.text else {}
            out.append(self._chunk({"index": 0, "delta": body, "logprobs": self._logprobs(delta.logprobs),
                                    "finish_reason": delta.finish_reason}, delta.token_ids))
        return out

    def sse(self, delta: Delta, first: bool, index: int = 0) -> bytes:
        """`chunks(delta, first)` as SSE events, for choice `index` (module docstring)."""
        before, after = self._head()
        out = ""
        if first:
            out = f'{before}{index}, "delta": {{"role": "assistant", "content": ""}}, "logprobs": null, "finish_reason": null{after}'
        if delta.text or delta.logprobs or delta.finish_reason or self._has_ids(delta):
            body = f'{{"content": {_json_str(delta.text)}}}' if delta.text else "{}"
            out += f'{before}{index}, "delta": {body}, {self._tail_fields(delta)}{after}'
        return out.encode()

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if self.top_logprobs is None:
            return None
        return {"content": [{**_chat_entry(e.token, e.logprob),
                             "top_logprobs": [_chat_entry(t, lp) for t, lp in e.top[: self.top_logprobs]]}
                            for e in entries]}


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
