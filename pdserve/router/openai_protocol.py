"""OpenAI request bodies → prompt token ids + `SamplingParams`, and OpenAI error bodies.

Every check that can fail a request with a 4xx happens here, before any node is involved:
the JSON shape, the types (nested ones too: `stream_options`, `messages[*]`, `stop`,
`stop_token_ids`), the value ranges (integers must fit the wire's int64; SamplingParams's own
messages for the rest), the model name, the chat roles, the prompt (empty, too long for the
nodes' max_model_len, token ids outside the vocabulary), a max_tokens the context cannot hold, and
OpenAI parameters pdserve does not implement, which are accepted only at their neutral value.
Unknown fields are ignored, as vLLM does, and logged at WARNING once per field name per process.
router/openapi.py describes the same fields; a test keeps the two in step.

max_tokens and the context (as vLLM): with max_model_len known (a ready node declared it),

    |<------------------------- max_model_len ------------------------->|
    |<----- prompt_len ----->|<------------- room --------------------->|

an explicit max_tokens (or max_completion_tokens) larger than `room` is a 400; without one the
default (16 for completions; the whole room for chat) is clamped to `room`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.openai_errors import ProtocolError
from pdserve.router.openai_errors import short as _short

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy default
DEFAULT_CHAT_MAX_TOKENS = 1024  # chat has no default limit; used when no node declared max_model_len
MAX_LOGPROBS = 20
MAX_N = 128  # choices per request (n); a node also refuses n above its max_num_seqs
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # msgpack (the wire) and vLLM's seed range
# SamplingParams takes any repetition_penalty > 0, but far from 1 the float32 sampler turns logits
# into inf and NaN (x / 1e-40, 0 * 1e39) and fails the whole batch; typical values are 0.5 to 2.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-6, 1e6

_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "n")
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", dict: "object", list: "array"}


def _only(*values: Any) -> Callable[[Any], bool]:
    """Accepts null or one of `values`, compared with their JSON type (so true is not 1)."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


def _is_a(kind: type) -> Callable[[Any], bool]:
    return lambda v: v is None or isinstance(v, kind)


def _is_string_map(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values()))


# Parameters pdserve does not implement, and the test that a value is neutral (a no-op).
_NEUTRAL_COMMON: dict[str, Callable[[Any], bool]] = {
    "logit_bias": _only({}), "user": _is_a(str), "store": _only(False),
    "metadata": _is_string_map, "service_tier": _only("auto", "default")}
_NEUTRAL_COMPLETION = {**_NEUTRAL_COMMON, "best_of": _only(1), "echo": _only(False), "suffix": _only("")}
_NEUTRAL_CHAT = {**_NEUTRAL_COMMON, "tools": _only([]), "functions": _only([]), "tool_choice": _only("none"),
                 "function_call": _only("none"), "parallel_tool_calls": _is_a(bool),
                 "response_format": _only({"type": "text"}), "modalities": _only(["text"]),
                 "audio": _only(), "prediction": _only()}

# Every field the parsers read (router/openapi.py describes exactly these); others are logged.
_COMMON_FIELDS = ("model", "max_tokens", "logprobs", "stream", "stream_options", "return_token_ids",
                  *_SAMPLING_FIELDS)
COMPLETION_FIELDS = frozenset({"prompt", *_COMMON_FIELDS, *_NEUTRAL_COMPLETION})
CHAT_FIELDS = frozenset({"messages", "max_completion_tokens", "top_logprobs", *_COMMON_FIELDS, *_NEUTRAL_CHAT})
# OpenAI's roles; "function" is the deprecated form of "tool" (pdserve accepts `functions: []`).
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer", "function")
MAX_LOGGED_UNKNOWN_FIELDS = 1000  # distinct names; a client sending random keys must not grow the set forever


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
    _unknown_fields.note("/v1/completions", body, COMPLETION_FIELDS)
    prompt_token_ids = _prompt_ids(body.get("prompt"), tokenizer)
    _check_prompt(prompt_token_ids, tokenizer, max_model_len)
    max_tokens = _fit_context(_opt_int(body, "max_tokens", None, lo=1), DEFAULT_COMPLETION_MAX_TOKENS,
                              len(prompt_token_ids), max_model_len)
    logprobs = _opt_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    sampling = _sampling(body, max_tokens, logprobs)
    return ParsedRequest("completion", prompt_token_ids, sampling, *_stream(body), logprobs,
                         _opt(body, "return_token_ids", bool, False))


def parse_chat(body: Any, tokenizer, model_name: str, max_model_len: int | None) -> ParsedRequest:
    body = _check_common(body, model_name, _NEUTRAL_CHAT)
    _unknown_fields.note("/v1/chat/completions", body, CHAT_FIELDS)
    prompt_token_ids = _chat_prompt_ids(body.get("messages"), tokenizer)
    _check_prompt(prompt_token_ids, tokenizer, max_model_len)
    max_tokens = _opt_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens", None, lo=1)
    default = max_model_len - len(prompt_token_ids) if max_model_len else DEFAULT_CHAT_MAX_TOKENS
    max_tokens = _fit_context(max_tokens, default, len(prompt_token_ids), max_model_len)
    top_logprobs = None
    if _opt(body, "logprobs", bool, False):
        top_logprobs = _opt_int(body, "top_logprobs", 0, lo=0, hi=MAX_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise ProtocolError("top_logprobs needs logprobs set to true", param="top_logprobs")
    sampling = _sampling(body, max_tokens, top_logprobs)
    return ParsedRequest("chat", prompt_token_ids, sampling, *_stream(body), top_logprobs,
                         _opt(body, "return_token_ids", bool, False))


# ---- pieces -------------------------------------------------------------------------------------
def _check_common(body: Any, model_name: str, neutral: dict[str, Callable[[Any], bool]]) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = _opt(body, "model", str, None)
    if model is not None and model != model_name:
        raise ProtocolError(f"The model `{_short(model)}` does not exist.", status=404, param="model")
    for name, is_neutral in neutral.items():
        if name in body and not is_neutral(body[name]):
            raise ProtocolError(f"{name}={_short(body[name])} is not supported", param=name)
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(body: dict, name: str, kind: type, default: Any) -> Any:
    """A field of one JSON type, or `default` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if kind is int:
        ok = _is_int(value)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ProtocolError(f"{name} must be of type {_JSON_TYPES[kind]}, got {type(value).__name__}", param=name)
    return value


def _opt_int(body: dict, name: str, default: int | None, *, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int | None:
    value = _opt(body, name, int, default)
    if value is not None and not lo <= value <= hi:
        low, high = ("-2**63" if lo == INT64_MIN else lo), ("2**63-1" if hi == INT64_MAX else hi)
        raise ProtocolError(f"{name} must be an integer in [{low}, {high}], got {_short(value)}", param=name)
    return value


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _opt(body, "stream", bool, False)
    options = _opt(body, "stream_options", dict, {})
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ProtocolError("stream_options.include_usage must be a boolean", param="stream_options")
    return stream, bool(include_usage)


def _sampling(body: dict, max_tokens: int, logprobs: int | None) -> SamplingParams:
    values = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    stop = values.get("stop")
    if not (stop is None or isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise ProtocolError("stop must be a string or a list of strings", param="stop")
    stop_token_ids = values.get("stop_token_ids", [])
    if not (isinstance(stop_token_ids, list) and all(_is_int(t) and 0 <= t <= INT64_MAX for t in stop_token_ids)):
        raise ProtocolError("stop_token_ids must be a list of non-negative integers", param="stop_token_ids")
    for name in ("top_k", "seed"):  # the engine would take any int; the wire takes int64
        _opt_int(values, name, None)
    _opt_int(values, "n", None, lo=1, hi=MAX_N)
    penalty = _opt(values, "repetition_penalty", float, 1.0)
    if not MIN_REPETITION_PENALTY <= penalty <= MAX_REPETITION_PENALTY:
        raise ProtocolError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], "
                            f"got {penalty!r}", param="repetition_penalty")
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **values)
    except (ValueError, TypeError) as e:
        match = re.search(r"SamplingParams\.(\w+)", str(e))
        raise ProtocolError(_short(str(e)), param=match.group(1) if match else None) from None


def _prompt_ids(prompt: Any, tokenizer) -> list[int]:
    """A string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise ProtocolError("only one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        try:
            return list(tokenizer.encode(prompt))
        except Exception as e:  # e.g. a lone surrogate, which JSON allows and tokenizers refuse
            raise ProtocolError(f"cannot tokenize the prompt: {_short(str(e))}", param="prompt") from None
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return list(prompt)
    raise ProtocolError("prompt must be a string or a list of token ids", param="prompt")


def _chat_prompt_ids(messages: Any, tokenizer) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("messages must be a non-empty list", param="messages")
    plain = [_plain_message(i, m) for i, m in enumerate(messages)]
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja errors, a tokenizer without a chat template, ...
        raise ProtocolError(f"cannot apply the chat template: {_short(str(e))}", param="messages") from None
    if not isinstance(ids, list):  # transformers 5 answers with a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def _plain_message(index: int, message: Any) -> dict:
    """One message as the template expects it: role, content as a plain string, and name if given.
    Other keys (tool_calls, ...) are dropped: pdserve refuses tools, so they have no meaning here."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ProtocolError("each message must be an object with a string role", param="messages")
    if message["role"] not in CHAT_ROLES:
        raise ProtocolError(f"messages[{index}].role must be one of {', '.join(map(repr, CHAT_ROLES))}; "
                            f"got {_short(repr(message['role']))}", param="messages")
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ProtocolError("only text content parts are supported", param="messages")
        content = "".join(p["text"] for p in content)
    elif content is not None and not isinstance(content, str):
        raise ProtocolError("message content must be a string or a list of text parts", param="messages")
    plain = {"role": message["role"], "content": content or ""}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            raise ProtocolError("a message's name must be a string", param="messages")
        plain["name"] = name
    return plain


def _check_prompt(ids: list[int], tokenizer, max_model_len: int | None) -> None:
    if not ids:
        raise ProtocolError("the prompt must not be empty", param="prompt")
    vocab_size = len(tokenizer)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"token id {_short(bad)} is outside the vocabulary (size {vocab_size})", param="prompt")
    if max_model_len is not None and len(ids) + 1 > max_model_len:
        raise ProtocolError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{len(ids)} tokens and needs room for at least one output token", param="prompt")


def _fit_context(max_tokens: int | None, default: int, prompt_len: int, max_model_len: int | None) -> int:
    """The request's max_tokens: the client's (`max_tokens`, a 400 when the context cannot hold it, in
    vLLM's words), else `default` clamped to the room the prompt leaves. Without max_model_len
    (no ready node declared one) nothing is checked."""
    if max_model_len is None:
        return default if max_tokens is None else max_tokens
    room = max_model_len - prompt_len  # >= 1: _check_prompt ran
    if max_tokens is None:
        return min(default, room)
    if max_tokens > room:
        raise ProtocolError(f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                            f"{max_tokens} in the completion). Please reduce the length of the messages or "
                            "completion.", param="max_tokens")
    return max_tokens


class _UnknownFieldLog:
    """Logs the request fields no parser reads, once per field name per process: a client that
    sends the same typo with every request gets one WARNING, not one per request. At most
    `limit` names are remembered; past that, new names are no longer logged."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.logged: set[str] = set()

    def note(self, endpoint: str, body: dict, known: frozenset[str]) -> None:
        new = sorted(k for k in body if k not in known and k not in self.logged)
        if not new or len(self.logged) >= self.limit:
            return
        new = new[: self.limit - len(self.logged)]
        self.logged.update(new)
        logger.warning("%s: ignoring unknown request field(s) %s (each logged once)%s", endpoint,
                       ", ".join(_short(repr(k)) for k in new),
                       "; no further unknown field names will be logged" if len(self.logged) >= self.limit else "")


_unknown_fields = _UnknownFieldLog(MAX_LOGGED_UNKNOWN_FIELDS)
