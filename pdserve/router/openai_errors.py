"""OpenAI error bodies: `{"error": {"message", "type", "param", "code"}}`, and `ProtocolError`, the
exception that carries one from wherever a request is refused (router/openai_protocol.py, the
Router, the app) to the HTTP answer (router/app.py)."""

from __future__ import annotations

import reprlib
from typing import Any

MAX_MESSAGE_CHARS = 500  # a refused value is quoted in the error message up to this length

# The `type` of an error body, by HTTP status: the openai client's exception class names (the
# convention vLLM follows; OpenAI itself sends snake_case types).
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
                413: "RequestEntityTooLargeError", 422: "UnprocessableEntityError", 429: "RateLimitError",
                500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = MAX_MESSAGE_CHARS


class ProtocolError(Exception):
    """A request the router refuses; `body()` is the OpenAI error body, `status` the HTTP status,
    `headers` extra response headers (Retry-After on a 429, WWW-Authenticate on a 401)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = type or error_type(status)
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.status, param=self.param, type=self.type)


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_body(message: str, status: int, *, param: str | None = None, type: str | None = None) -> dict:
    return {"error": {"message": message, "type": type or error_type(status), "param": param, "code": status}}


def short(value: Any) -> str:
    """A refused value for an error message: bounded in length and depth whatever the client sent."""
    text = value if isinstance(value, str) else _REPR.repr(value)
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + "..."
