"""OpenAI request bodies → prompt token ids + `SamplingParams`, and OpenAI error bodies.

Every check that can fail a request with a 4xx happens here, before any node is involved:
the JSON shape, the types, the value ranges (SamplingParams's own messages), the model name,
the prompt (empty, too long for the nodes' max_model_len, token ids outside the vocabulary),
and OpenAI parameters pdserve does not implement, which are accepted only at their neutral value.
Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy default
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat has no default limit; used when no node declared max_model_len
MAX_LOGPROBS = 20

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                503: "ServiceUnavailableError", 504: "TimeoutError"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos")


def _is_one(v: Any) -> bool:
    return v is None or (v == 1 and not isinstance(v, bool))


def _is_empty(v: Any) -> bool:
    return v is None or v in ("", [], {})


# Parameters pdserve does not implement, and the test that a value is neutral (a no-op).
_NEUTRAL_COMMON: dict[str, Callable[[Any], bool]] = {"n": _is_one, "logit_bias": _is_empty}
_NEUTRAL_COMPLETION = {**_NEUTRAL_COMMON, "best_of": _is_one, "echo": lambda v: v in (None, False),
                       "suffix": _is_empty}
_NEUTRAL_CHAT = {**_NEUTRAL_COMMON, "tools": _is_empty, "functions": _is_empty,
                 "tool_choice": lambda v: v in (None, "none"), "function_call": lambda v: v in (None, "none"),
                 "response_format": lambda v: v is None or v == {"type": "text"},
                 "modalities": lambda v: v is None or v == ["text"], "audio": _is_empty, "prediction": _is_empty}


class ProtocolError(Exception):
    """A request the router refuses; `body()` is the OpenAI error body, `status` the HTTP status."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = type or _ERROR_TYPES.get(status, "InternalServerError")

    def body(self) -> dict:
        return error_body(self.message, self.status, param=self.param, type=self.type)


def error_body(message: str, status: int, *, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "InternalServerError"),
                      "param": param, "code": status}}


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    top_logprobs: int | None  # chat: top entries per token (None = no logprobs)
    return_token_ids: bool = False  # vLLM's extension: the output token ids in each choice / chunk


def parse_completion(body: Any, tokenizer, model_name: str, max_model_len: int | None) -> ParsedRequest:
    body = _check_common(body, model_name, _NEUTRAL_COMPLETION)
    prompt_token_ids = _prompt_ids(body.get("prompt"), tokenizer)
    _check_prompt(prompt_token_ids, tokenizer, max_model_len)
    max_tokens = _opt(body, "max_tokens", int, DEFAULT_COMPLETION_MAX_TOKENS)
    logprobs = _opt(body, "logprobs", int, None)
    sampling = _sampling(body, max_tokens, logprobs)
    return ParsedRequest("completion", prompt_token_ids, sampling, *_stream(body), logprobs,
                         _opt(body, "return_token_ids", bool, False))


def parse_chat(body: Any, tokenizer, model_name: str, max_model_len: int | None) -> ParsedRequest:
    body = _check_common(body, model_name, _NEUTRAL_CHAT)
    prompt_token_ids = _chat_prompt_ids(body.get("messages"), tokenizer)
    _check_prompt(prompt_token_ids, tokenizer, max_model_len)
    default = max_model_len - len(prompt_token_ids) if max_model_len else DEFAULT_CHAT_MAX_TOKENS
    max_tokens = _opt(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = _opt(body, "max_tokens", int, default)
    top_logprobs = None
    if _opt(body, "logprobs", bool, False):
        top_logprobs = _opt(body, "top_logprobs", int, 0)
    elif body.get("top_logprobs") is not None:
        raise ProtocolError("top_logprobs needs logprobs set to true", param="top_logprobs")
    sampling = _sampling(body, max_tokens, top_logprobs)
    return ParsedRequest("chat", prompt_token_ids, sampling, *_stream(body), top_logprobs,
                         _opt(body, "return_token_ids", bool, False))


# ---- pieces -------------------------------------------------------------------------------------
def _check_common(body: Any, model_name: str, neutral: dict[str, Callable[[Any], bool]]) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise ProtocolError(f"The model `{model}` does not exist.", status=404, param="model")
    for name, is_neutral in neutral.items():
        if name in body and not is_neutral(body[name]):
            raise ProtocolError(f"{name}={body[name]!r} is not supported", param=name)
    return body


def _opt(body: dict, name: str, kind: type, default: Any) -> Any:
    """A field of one JSON type, or `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ProtocolError(f"{name} must be of type {kind.__name__}, got {type(value).__name__}", param=name)
    return value


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _opt(body, "stream", bool, False)
    options = _opt(body, "stream_options", dict, {})
    include_usage = options.get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise ProtocolError("stream_options.include_usage must be a boolean", param="stream_options")
    return stream, include_usage


def _sampling(body: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
    values = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    stop = values.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise ProtocolError("stop must be a string or a list of strings", param="stop")
    if not isinstance(values.get("stop_token_ids", []), list):
        raise ProtocolError("stop_token_ids must be a list of integers", param="stop_token_ids")
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)
    except (ValueError, TypeError) as e:
        match = re.search(r"SamplingParams\.(\w+)", str(e))
        raise ProtocolError(str(e), param=match.group(1) if match else None) from None


def _prompt_ids(prompt: Any, tokenizer) -> list[int]:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise ProtocolError("only one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ProtocolError("prompt must be a string or a list of token ids", param="prompt")


def _chat_prompt_ids(messages: Any, tokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", param="messages")
    plain = [_plain_message(m) for m in messages]
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja errors, a tokenizer without a chat template, ...
        raise ProtocolError(f"cannot apply the chat template: {e}", param="messages") from None
    if not isinstance(ids, list):  # transformers 5 answers with a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _plain_message(message: Any) -> dict:
    """One message with its content as a plain string (templates expect strings)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ProtocolError("each message must be an object with a string role", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ProtocolError("only text content parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ProtocolError("message content must be a string or a list of text parts", param="messages")
    return {**message, "content": content or ""}


def _check_prompt(ids: list[int], tokenizer, max_model_len: int | None) -> None:
    if not ids:
        raise ProtocolError("the prompt must not be empty", param="prompt")
    vocab_size = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"token id {bad} is outside the vocabulary (size {vocab_size})", param="prompt")
    if max_model_len is not None and len(ids) + 1 > max_model_len:
        raise ProtocolError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{len(ids)} tokens and needs room for at least one output token", param="prompt")
