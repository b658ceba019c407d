"""The OpenAPI 3.1 description of the router's HTTP API, served at GET /openapi.json.

Written by hand and kept small: the request schemas list every field router/openai_protocol.py
reads, with the types and ranges it enforces (a test checks the two agree, and the fuzz test
builds its requests from these schemas). Every optional field also takes null, meaning "absent".
Fields outside these schemas are ignored (and logged once per name).
OpenAI parameters pdserve does not implement appear with the one neutral value it accepts.
"""

from __future__ import annotations

from typing import Any

from pdserve.router.openai_protocol import (
    CHAT_ROLES,
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
)

Schema = dict[str, Any]


def _nullable(schema: Schema) -> Schema:
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int = INT64_MIN, hi: int = INT64_MAX, description: str = "") -> Schema:
    return {"type": "integer", "minimum": lo, "maximum": hi, **({"description": description} if description else {})}


def _num(description: str = "", **bounds: float) -> Schema:
    return {"type": "number", **bounds, **({"description": description} if description else {})}


def _const(value: Any, description: str = "not supported: only this neutral value") -> Schema:
    return {"const": value, "description": description}


_BOOL: Schema = {"type": "boolean"}
_TOKEN_IDS: Schema = {"type": "array", "items": _int(0), "minItems": 1}

_COMMON: dict[str, Schema] = {
    "model": {"type": "string", "description": "the served model name; other names get a 404"},
    "max_tokens": _int(1),
    "temperature": _num("0 = greedy", minimum=0),
    "top_p": _num("nucleus sampling", exclusiveMinimum=0, maximum=1),
    "top_k": _int(-1, description="-1 or 0 = all tokens, else >= 1"),
    "min_p": _num("relative probability floor", minimum=0, maximum=1),
    "presence_penalty": _num(minimum=-2, maximum=2),
    "frequency_penalty": _num(minimum=-2, maximum=2),
    "repetition_penalty": _num("HF-style, over prompt and output", minimum=MIN_REPETITION_PENALTY,
                               maximum=MAX_REPETITION_PENALTY),
    "seed": _int(description="the draw at output position i depends only on (seed, i)"),
    "stop": {"oneOf": [{"type": "string", "minLength": 1},
                       {"type": "array", "items": {"type": "string", "minLength": 1}}]},
    "stop_token_ids": {"type": "array", "items": _int(0)},
    "ignore_eos": _BOOL,
    "stream": _BOOL,
    "stream_options": {"type": "object", "properties": {"include_usage": _nullable(_BOOL)}},
    "return_token_ids": {**_BOOL, "description": "vLLM's extension: output token ids in each choice and chunk"},
    "n": _int(1, MAX_N, "choices: one prefill, its KV blocks shared; choice i seeded with seed + i"),
    "logit_bias": {"type": "object", "maxProperties": 0, "description": "not supported: only {}"},
    "user": {"type": "string", "description": "accepted and ignored"},
    "store": _const(False),
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}, "description": "ignored"},
    "service_tier": {"enum": ["auto", "default"]},
}
_COMPLETION: dict[str, Schema] = {
    "prompt": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,
                         {"type": "array", "items": {"oneOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS]},
                          "minItems": 1, "maxItems": 1}],
               "description": "text or token ids, alone or as a one-element batch"},
    **_COMMON,
    "logprobs": _int(0, MAX_LOGPROBS, "top-n logprobs per output token"),
    "best_of": _const(1), "echo": _const(False), "suffix": _const(""),
}
_TEXT_PART: Schema = {"type": "object", "required": ["type", "text"],
                      "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_MESSAGE: Schema = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": list(CHAT_ROLES)},
    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    "name": _nullable({"type": "string"})}}
_CHAT: dict[str, Schema] = {
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    **_COMMON,
    "max_completion_tokens": _int(1, description="wins over max_tokens"),
    "logprobs": _BOOL,
    "top_logprobs": _int(0, MAX_LOGPROBS, "needs logprobs: true"),
    "tools": {"type": "array", "maxItems": 0, "description": "not supported: only []"},
    "functions": {"type": "array", "maxItems": 0, "description": "not supported: only []"},
    "tool_choice": _const("none"), "function_call": _const("none"),
    "parallel_tool_calls": {"type": "boolean", "description": "ignored"},
    "response_format": _const({"type": "text"}), "modalities": _const(["text"]),
    "audio": {"type": "null"}, "prediction": {"type": "null"},
}


def _request(properties: dict[str, Schema], required: str) -> Schema:
    props = {k: v if k == required else _nullable(v) for k, v in properties.items()}
    return {"type": "object", "required": [required], "properties": props, "additionalProperties": True}


COMPLETION_REQUEST = _request(_COMPLETION, "prompt")
CHAT_REQUEST = _request(_CHAT, "messages")

_USAGE: Schema = {"type": "object", "properties": {k: {"type": "integer"} for k in
                                                    ("prompt_tokens", "completion_tokens", "total_tokens")}}
_FINISH: Schema = {"enum": ["stop", "length", None]}


def _envelope(obj: str, choice: dict[str, Schema]) -> Schema:
    return {"type": "object", "required": ["id", "object", "created", "model", "choices"], "properties": {
        "id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
        "model": {"type": "string"}, "usage": _nullable(_USAGE),
        "choices": {"type": "array", "items": {"type": "object", "properties": {
            "index": {"type": "integer"}, "finish_reason": _FINISH, "logprobs": {"type": ["object", "null"]},
            "token_ids": {"type": "array", "items": {"type": "integer"}}, **choice}}}}}


_MESSAGE_OUT: Schema = {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}
ERROR_RESPONSE: Schema = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string", "description": "e.g. BadRequestError"},
        "param": {"type": ["string", "null"]}, "code": {"type": "integer", "description": "the HTTP status"}}}}}


def _json(schema: Schema) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict:
    return {"description": description, **_json({"$ref": "#/components/schemas/ErrorResponse"})}


def _generate(summary: str, request: str, response: str, chunk: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, **_json({"$ref": f"#/components/schemas/{request}"})},
        "responses": {
            "200": {"description": "the completion; with stream: true, server-sent events, one chunk per "
                                   "`data:` line, ended by `data: [DONE]` (errors after the first chunk "
                                   "come as a `data:` line holding an error body)",
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{response}"}},
                                "text/event-stream": {"schema": {"$ref": f"#/components/schemas/{chunk}"}}}},
            "400": _error("invalid parameters, a prompt too long for max_model_len, or a max_tokens that "
                          "does not fit in max_model_len with the prompt"),
            "401": _error("missing or wrong API key (only when the router has one)"),
            "404": _error("unknown model name"),
            "413": _error("body larger than the router accepts"),
            "429": _error("every node of a role is at its queue limit; see Retry-After"),
            "500": _error("a node failed the request"),
            "503": _error("no ready node of a role, or a node left mid-request"),
            "504": _error("the request passed its deadline"),
        }}}


def _get(summary: str, content_type: str, schema: Schema, **responses: dict) -> dict:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "OK", "content": {content_type: {"schema": schema}}}, **responses}}}


_NODE: Schema = {"type": "object", "properties": {
    "node_id": {"type": "string"}, "role": {"enum": ["prefill", "decode", "both"]}, "ready": _BOOL,
    "status_url": {"type": "string"}, "kv_addr": {"type": "string"}, "num_total_blocks": {"type": "integer"},
    "num_free_blocks": {"type": ["integer", "null"]}, "num_running": {"type": ["integer", "null"]},
    "num_waiting": {"type": ["integer", "null"]}, "prefill_load": {"type": "integer"},
    "seconds_since_heartbeat": {"type": "number"},
    "changing_to": {"enum": ["prefill", "decode", None], "description": "the role a SetRole asked for, until the "
                    "node registers with it"},
    "speed": {"type": "object", "description": "its step time, fitted from its heartbeats (router/speed.py)"}}}
_PLANNER: Schema = {"type": "object", "properties": {
    "split": {"type": ["array", "null"], "items": {"type": "integer"}, "description": "[prefill, decode] wanted"},
    "desired": {"type": "object", "description": "pool sizes wanted, by pool"},
    "reason": {"type": "string"}, "changes": {"type": "array"}, "predictions": {"type": "array"}}}
_MODELS: Schema = {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {
    "type": "object", "properties": {k: {"type": "string"} for k in ("id", "object", "owned_by", "root")}}}}}

_HEALTH: Schema = {"type": "object", "required": ["status", "instance_id"], "properties": {
    "status": {"type": "string", "description": "ok, or why not"},
    "instance_id": {"type": "string", "description": "the router process's id (`pdserve router --instance-id`)"}}}

_SECURED = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/nodes", "/nodes/{node_id}/role",
            "/planner")  # all but router/app.py's OPEN_PATHS


def openapi_spec(*, with_api_key: bool = False) -> dict:
    """The description; `with_api_key` marks the endpoints that need the bearer token."""
    paths = {
        "/v1/completions": _generate("Text completion", "CompletionRequest", "Completion", "CompletionChunk"),
        "/v1/chat/completions": _generate("Chat completion through the model's chat template", "ChatCompletionRequest",
                                          "ChatCompletion", "ChatCompletionChunk"),
        "/v1/models": _get("The served model", "application/json", _MODELS),
        "/health": _get("200 while a ready prefill-capable and a ready decode-capable node are registered",
                        "application/json", _HEALTH, **{"503": {"description": "not healthy",
                                                                **_json(_HEALTH)}}),
        "/nodes": _get("The live nodes and their load", "application/json",
                       {"type": "object", "properties": {"nodes": {"type": "array", "items": _NODE}}}),
        "/nodes/{node_id}/role": {"post": {
            "summary": "Ask a node to serve another role: it drains, then registers again with it",
            "parameters": [{"name": "node_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["role"], "properties": {"role": {"enum": ["prefill", "decode"]}}}}}},
            "responses": {"202": {"description": "SetRole sent"}, "400": {"description": "bad body"},
                          "404": {"description": "no such node"},
                          "409": {"description": "refused: already that role, the last decode node, a 'both' node"}}}},
        "/planner": _get("The planner's last decision (404 without --planner)", "application/json", _PLANNER),
        "/metrics": _get("Prometheus metrics", "text/plain", {"type": "string"}),
        "/openapi.json": _get("This description", "application/json", {"type": "object"}),
    }
    if with_api_key:
        for path in _SECURED:
            for operation in paths[path].values():
                operation["security"] = [{"bearer": []}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve router", "version": "1",
                 "description": "OpenAI-compatible API of a disaggregated prefill/decode server"},
        "paths": paths,
        "components": {
            "schemas": {
                "CompletionRequest": COMPLETION_REQUEST, "ChatCompletionRequest": CHAT_REQUEST,
                "Completion": _envelope("text_completion", {"text": {"type": "string"}}),
                "CompletionChunk": _envelope("text_completion", {"text": {"type": "string"}}),
                "ChatCompletion": _envelope("chat.completion", {"message": _MESSAGE_OUT}),
                "ChatCompletionChunk": _envelope("chat.completion.chunk", {"delta": {"type": "object", "properties": {
                    "role": {"const": "assistant"}, "content": {"type": "string"}}}}),
                "ErrorResponse": ERROR_RESPONSE,
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "the router's --api-key (PDSERVE_API_KEY)"}},
        },
    }
