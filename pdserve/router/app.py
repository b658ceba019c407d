"""The OpenAI-compatible HTTP API (aiohttp) in front of a `Router`.

    POST /v1/completions        text completion, SSE when "stream": true
    POST /v1/chat/completions   chat through the tokenizer's chat template
    GET  /v1/models             the served model
    GET  /health                200 while a ready prefill-capable and decode-capable node are registered,
                                else 503; both carry the router's instance id (see create_app)
    GET  /nodes                 the live nodes, their role, load, fitted speed and status URLs
    POST /nodes/{id}/role       {"role": "prefill"|"decode"}: the node drains and serves that role,
                                model still loaded (202; 404 unknown node; 409 refused, e.g. the
                                last decode node)
    GET  /planner               the planner's last decision, its reason and the pool sizes it wants
                                (404 without --planner); `pdserve serve` scales from it
    GET  /metrics               Prometheus text format (router/metrics.py)
    GET  /openapi.json          the OpenAPI description of all of these (router/openapi.py)

With an API key, every request but /health, /metrics and /openapi.json must carry
`Authorization: Bearer <key>`, else it gets a 401. Every error is an OpenAI error body, whatever
raised it (the parser, the router, aiohttp itself: unknown path, wrong method, a body over
MAX_BODY_BYTES).

A generation request is validated (4xx before any node sees it), submitted, then its deltas are
written as they come. A streamed response is only started once the first delta is in, so an
error before the first token still gets a real HTTP status; after that errors are an SSE
`data: {"error": ...}` event. A handler sleeps until the router pushes deltas to its request
(`ChoiceGroup.wait_deltas`: a request is a group of its n choices, router/choices.py, n = 1
included), and writes all of them at once; a non-streamed one is woken at the end only.
When the router itself lags, new requests get a 429 (router/saturation.py). Whatever way the handler ends (finished, client gone, cancelled),
`router.release_choices` runs, and it sends Abort to the nodes if the request had not ended.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import time
import uuid

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4  # the text format every Prometheus reads

from pdserve.router.choice_group import ChoiceGroup
from pdserve.router.openai_errors import ProtocolError, error_body
from pdserve.router.openai_responses import ChatFormat, CompletionFormat, new_request_id
from pdserve.router.openapi import openapi_spec
from pdserve.router.registry import node_summary
from pdserve.router.request_state import RouterError
from pdserve.router.router import Router

logger = logging.getLogger(__name__)

ROUTER_KEY = web.AppKey("router", Router)
CREATED_KEY = web.AppKey("created", int)  # for /v1/models
API_KEY_KEY = web.AppKey("api_key", bytes)
INSTANCE_ID_KEY = web.AppKey("instance_id", str)  # for /health
MAX_BODY_BYTES = 64 << 20  # token-id prompts are verbose JSON
DISCONNECT_POLL_S = 0.5  # how often a handler waiting for tokens checks that its client is still there
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")  # no API key needed (probes, scrapers, docs)


def create_app(router: Router, *, api_key: str | None = None, instance_id: str | None = None) -> web.Application:
    """The HTTP app; the caller owns `router` (start it before serving, close it after). With
    `api_key`, requests outside OPEN_PATHS must send it as a bearer token. GET /health answers
    `instance_id` (default: a random uuid4 hex), so that whoever started this router (the
    launcher, `pdserve serve`) can tell it from another process on the same port."""
    middlewares = [_openai_errors] + ([_check_api_key] if api_key else [])
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares)
    app[ROUTER_KEY] = router
    app[CREATED_KEY] = int(time.time())
    app[INSTANCE_ID_KEY] = instance_id or uuid.uuid4().hex
    if api_key:
        app[API_KEY_KEY] = api_key.encode()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/nodes", _nodes)
    app.router.add_get("/planner", _planner)
    app.router.add_post("/nodes/{node_id}/role", _set_role)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/openapi.json", _openapi)
    return app


@web.middleware
async def _openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI error body: {"error": {message, type, param, code}}."""
    metrics = request.app[ROUTER_KEY].metrics  # errors from a request's own end are counted by the Router
    try:
        return await handler(request)
    except ProtocolError as e:
        metrics.observe_error(e.status)
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        metrics.observe_error(e.status)
        headers = {k: v for k, v in e.headers.items() if k not in ("Content-Type", "Content-Length")}  # Allow, ...
        return web.json_response(error_body(e.reason, e.status), status=e.status, headers=headers)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception:
        logger.exception("error serving %s %s", request.method, request.path)
        metrics.observe_error(500)
        return web.json_response(error_body("internal error", 500), status=500)


@web.middleware
async def _check_api_key(request: web.Request, handler) -> web.StreamResponse:
    """401 unless the request is for an open path or carries the key (compared in constant time)."""
    resource = request.match_info.route.resource  # None when no route matched: closed, like the rest
    if resource is not None and resource.canonical in OPEN_PATHS:
        return await handler(request)
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ProtocolError("missing API key: send it as the header `Authorization: Bearer <key>`",
                            status=401, headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(token.strip().encode("utf-8", "surrogatepass"), request.app[API_KEY_KEY]):
        raise ProtocolError("Incorrect API key provided", status=401, headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_spec(with_api_key=API_KEY_KEY in request.app))


async def _models(request: web.Request) -> web.Response:
    name = request.app[ROUTER_KEY].served_model_name
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": request.app[CREATED_KEY], "owned_by": "pdserve", "root": name}]})


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[ROUTER_KEY].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})


async def _health(request: web.Request) -> web.Response:
    instance_id = request.app[INSTANCE_ID_KEY]
    if request.app[ROUTER_KEY].is_healthy():
        return web.json_response({"status": "ok", "instance_id": instance_id})
    return web.json_response({"status": "no ready prefill and decode nodes", "instance_id": instance_id},
                             status=503)


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    router = request.app[ROUTER_KEY]
    parsed = router.parse(kind, await _read_json(request))
    request_id = new_request_id(kind)
    fmt_cls = ChatFormat if kind == "chat" else CompletionFormat
    fmt = fmt_cls(request_id, router.served_model_name, include_usage=parsed.stream and parsed.include_usage,
                  top_logprobs=parsed.top_logprobs, return_token_ids=parsed.return_token_ids)
    # n > 1: n choices from one prefill (router/choices.py); n = 1: a group of one
    if parsed.sampling.n > 1:
        group = await router.submit_choices(request_id, parsed)
    else:
        group = ChoiceGroup(request_id, parsed, [await router.submit(request_id, parsed)])
    try:
        if parsed.stream:
            return await _stream(request, group, fmt)
        return await _collect(request, group, fmt)
    except ConnectionResetError:  # the client went away (a write failed, or _ClientWatch saw it)
        raise asyncio.CancelledError from None  # as aiohttp's handler cancellation would: no 500, no log
    finally:  # on finish a no-op; on disconnect or cancellation it aborts the request on the nodes
        await router.release_choices(group)


async def _nodes(request: web.Request) -> web.Response:
    """The live nodes, their load and status URLs (like SGLang router's worker list)."""
    router: Router = request.app[ROUTER_KEY]
    return web.json_response({"nodes": [node_summary(n) for n in router.registry.nodes.values()]})


async def _set_role(request: web.Request) -> web.Response:
    """Ask a node to change role (docs/disaggregation.md#role-changes)."""
    router: Router = request.app[ROUTER_KEY]
    try:
        body = await _read_json(request)
    except ProtocolError as e:
        return _error_response(RouterError(e.message, e.status, e.type))
    role = body.get("role") if isinstance(body, dict) else None
    if role not in ("prefill", "decode"):
        return _error_response(RouterError('the body must be {"role": "prefill"} or {"role": "decode"}', 400,
                                           "BadRequestError"))
    node_id = request.match_info["node_id"]
    refused = await router.set_role(node_id, role)
    if refused is not None:
        status = 404 if node_id not in router.registry.nodes else 409
        return _error_response(RouterError(refused, status, "NotFoundError" if status == 404 else "ConflictError"))
    return web.json_response({"node_id": node_id, "role": role, "status": "changing"}, status=202)


async def _planner(request: web.Request) -> web.Response:
    """The planner's last decision (router/planner_loop.py)."""
    router: Router = request.app[ROUTER_KEY]
    if router.planner is None:
        return _error_response(RouterError("this router runs no planner (start it with --planner)", 404, "NotFoundError"))
    return web.json_response(router.planner.status())


async def _read_json(request: web.Request):
    """The body as JSON: 413 past MAX_BODY_BYTES; 400 for a body that cannot be read (bad gzip), for
    anything json.loads refuses, for NaN and Infinity (which Python's json accepts, JSON does not),
    and for nesting deeper than Python's stack."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ProtocolError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413) from None
    except web.RequestPayloadError as e:  # a body that does not match its Content-Encoding, ...
        detail = getattr(e.__cause__, "message", None) or str(e.__cause__ or e)
        raise ProtocolError(f"cannot read the request body: {detail}"[:300]) from None
    try:
        return json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ProtocolError(f"invalid JSON body: {str(e)[:200]}") from None


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999
        raise ValueError(f"{text[:50]} is out of range")
    return value


class _ClientWatch:
    """While a handler waits for a request's deltas, checks every DISCONNECT_POLL_S that its client
    is still there, and interrupts the wait once it is gone (so a stalled request is aborted without
    waiting for its next token). A timer, not a timeout per wait: a wait per step per stream is
    the hot path."""

    def __init__(self, request: web.Request, group: ChoiceGroup) -> None:
        self._request, self._group = request, group
        self._timer = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._check)

    def _check(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            self._group.interrupt(ConnectionResetError("client disconnected"))
        self._timer = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._check)

    def cancel(self) -> None:
        self._timer.cancel()


def _error_response(error: RouterError) -> web.Response:
    return web.json_response(error_body(error.message, error.status, type=error.type), status=error.status)


async def _collect(request: web.Request, group: ChoiceGroup, fmt) -> web.Response:
    for choice in group.choices:
        choice.wake_each_delta = False  # the handler has nothing to do before the end
    n = len(group.choices)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    watch = _ClientWatch(request, group)
    try:
        while None in finish:
            for i, delta in await group.wait_deltas():
                if delta.error is not None:
                    return _error_response(delta.error)
                texts[i].append(delta.text)
                logprobs[i].extend(delta.logprobs)
                finish[i] = delta.finish_reason or finish[i]
    finally:
        watch.cancel()
    usage_, choices = group.usage(), []
    for i, req in enumerate(group.choices):
        body = fmt.full("".join(texts[i]), finish[i], logprobs[i], usage_)
        choice = body["choices"][0]
        choice["index"] = i
        if fmt.return_token_ids:
            choice["token_ids"] = list(req.output_token_ids)
        choices.append(choice)
    body["choices"] = choices
    return web.json_response(body)


async def _stream(request: web.Request, group: ChoiceGroup, fmt) -> web.StreamResponse:
    """Whatever deltas came since the last write go out in one write: one per stream per step
    while the router keeps up, fewer and bigger when it falls behind. Each choice's chunks carry
    its `index`; one `[DONE]` (after the usage chunk, when asked) once every choice has ended."""
    watch = _ClientWatch(request, group)
    try:
        items = await group.wait_deltas()
        if items[0][1].error is not None:  # nothing sent yet: a real status
            return _error_response(items[0][1].error)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        metrics, n = request.app[ROUTER_KEY].metrics, len(group.choices)
        first, ended = [True] * n, [False] * n
        while True:
            start = time.perf_counter()
            events, num_tokens, done = [], 0, False
            for i, delta in items:
                if delta.error is not None:
                    events.append(_event(error_body(delta.error.message, delta.error.status, type=delta.error.type)))
                    done = True
                    break
                events.append(fmt.sse(delta, first[i], i))
                first[i], num_tokens = False, num_tokens + len(delta.token_ids)
                if delta.finish_reason is not None:
                    ended[i] = True
            if not done and all(ended):
                if fmt.include_usage:
                    events.append(_event(fmt.usage_chunk(group.usage())))
                done = True
            if done:
                events.append(b"data: [DONE]\n\n")
            data = b"".join(events)
            built = time.perf_counter()
            if data:
                await resp.write(data)
            metrics.add_stage("sse", built - start, num_tokens)
            metrics.add_stage("write", time.perf_counter() - built, num_tokens)
            if done:
                break
            items = await group.wait_deltas()
        await resp.write_eof()
        return resp
    finally:
        watch.cancel()


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
