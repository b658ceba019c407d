"""Parallel sampling (`n` > 1) at the router: one request, n choices.

The nodes run an n > 1 request as one prefill and one KV transfer under the request id, then as
n choices `{id}#{i}` (engine/request.py). The router holds one `RouterRequest` per choice under
those ids, so each re-sequences, detokenizes, checks its stop strings and ends on its own with
the code every request uses; a `ChoiceGroup` ties them together for the HTTP side (one wait for
any choice's deltas, chunks carrying each choice's `index`, usage summed over the choices).

    submit_choices   one PrefillRequest for the request id (sampling with n); every choice is
                     placed on the same nodes under its own id
    heartbeats       before the fork the nodes list the request id alone: it stands for its
                     choices (`_group_listed` refreshes them; a request id no live choice stands
                     behind is aborted as any unknown id)
    errors           an Error for the request id applies to each of its choices
    re-dispatch      one choice alone: its next attempt is an n = 1 request `{id}#{i}~k` with the
                     choice's derived seed, so it continues as an undisturbed run would
    release_choices  the HTTP side is done: every choice is released (aborting those not ended),
                     then, unless all ended normally, Abort(request id) clears what the nodes
                     still hold under it (a choice cannot be reached by its own id before the fork)

`ParallelSampling` is one part of `Router` (router.py); `serve_choices` is the HTTP side.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp import web

from pdserve.engine.request import child_id
from pdserve.kvtransfer.messages import Abort, Error, PrefillRequest
from pdserve.router.openai_errors import error_body
from pdserve.router.openai_responses import usage
from pdserve.router.registry import Route
from pdserve.router.request_state import Delta, RouterError, RouterRequest, RouterRequestStatus


class ChoiceGroup:
    """The n choices of one request, as the HTTP side waits for them (`RouterRequest`'s interface)."""

    def __init__(self, request_id: str, parsed, choices: list[RouterRequest]) -> None:
        self.request_id = request_id
        self.sampling = parsed.sampling  # n > 1: what the nodes get for the one prefill
        self.choices = choices
        self.node_ids: list[str] = []  # the nodes of the one dispatch

    def _ready(self) -> bool:
        return any(c.outbox and (c.wake_each_delta or c.status.is_done) for c in self.choices)

    async def wait_deltas(self) -> list[tuple[int, Delta]]:
        """(choice index, delta) pushed since the last call, waiting for one if there are none.
        The choices share one waiter, so a delta of any of them wakes the handler."""
        if not self._ready():
            waiter = asyncio.get_running_loop().create_future()
            for c in self.choices:
                c._waiter = waiter
            try:
                await waiter
            finally:
                for c in self.choices:
                    c._waiter = None
        return [(i, d) for i, c in enumerate(self.choices) for d in c.take_deltas()]

    def interrupt(self, error: BaseException) -> None:
        for c in self.choices:
            c.interrupt(error)

    def usage(self) -> dict:
        return usage(len(self.choices[0].prompt_token_ids), sum(len(c.output_token_ids) for c in self.choices))


class ParallelSampling:
    """Mixed into `Router`, whose state it uses and whose `_admit`, `_send`, `_redispatch`,
    `_fail` and `release` it calls."""

    groups: dict[str, ChoiceGroup]

    async def submit_choices(self, request_id: str, parsed) -> ChoiceGroup:
        """Like `Router.submit`, for n > 1: one dispatch for every choice (raises ProtocolError)."""
        deadline, route = self._admit(parsed)
        n, sampling = parsed.sampling.n, parsed.sampling
        choices = [RouterRequest(child_id(request_id, i), parsed.prompt_token_ids, sampling.for_choice(i),
                                 self.tokenizer, deadline=deadline) for i in range(n)]
        group = self.groups[request_id] = ChoiceGroup(request_id, parsed, choices)
        if not await self._dispatch_choices(group, route):
            for choice in choices:
                await self._redispatch(choice, f"prefill node {route.prefill.node_id} is unreachable")
        return group

    async def _dispatch_choices(self, group: ChoiceGroup, route: Route) -> bool:
        first = group.choices[0]
        prompt = first.prompt_token_ids
        for i, choice in enumerate(group.choices):
            choice.mark_dispatched(route.prefill.node_id, route.decode.node_id if route.decode else "")
            self.requests[choice.wire_id] = choice
            # the prompt is prefilled once: its tokens and blocks are counted with choice 0
            self.registry.add_request(route, choice.wire_id, len(prompt) if i == 0 else 0, choice.sampling.max_tokens)
        group.node_ids = first.node_ids
        msg = PrefillRequest(group.request_id, prompt, group.sampling.to_dict(), first.decode_node_id,
                             route.decode.register.kv_addr if route.decode else "",
                             arrival_time=first.timing.arrival_wall)
        return await self._send(route.prefill, msg)

    async def release_choices(self, group: ChoiceGroup, reason: str = "client disconnected") -> None:
        # (before `release` marks the unfinished ones aborted)
        ended_early = any(c.status != RouterRequestStatus.FINISHED or c.stopped_by_router for c in group.choices)
        for choice in group.choices:
            await self.release(choice, reason)
        if self.groups.get(group.request_id) is group:
            del self.groups[group.request_id]
        if ended_early:
            for node_id in group.node_ids:
                node = self.registry.nodes.get(node_id)
                if node is not None:
                    await self._send(node, Abort(group.request_id, reason))

    def _live_choices(self, request_id: str, node_id: str) -> list[RouterRequest]:
        """The choices of n > 1 request `request_id` whose current attempt is the one dispatch,
        on `node_id`, not ended: what the nodes hold under the request id stands for them."""
        group = self.groups.get(request_id)
        if group is None:
            return []
        return [c for c in group.choices if c.attempt == 0 and not c.status.is_done and node_id in c.node_ids]

    def _group_listed(self, node_id: str, request_id: str, now: float) -> bool:
        """A heartbeat of `node_id` lists `request_id`: True (and its choices count as listed) when
        it is an n > 1 request still dispatched there."""
        live = self._live_choices(request_id, node_id)
        for choice in live:
            choice.last_listed = now
        return bool(live)

    async def _group_error(self, msg: Error) -> bool:
        """An Error for an n > 1 request id applies to each choice there; False when it is none."""
        live = self._live_choices(msg.request_id, msg.node_id)
        for choice in live:
            if msg.retryable:
                await self._redispatch(choice, f"node {msg.node_id}: {msg.message}")
            else:
                await self._fail(choice, RouterError(f"node {msg.node_id}: {msg.message}", 500, "InternalServerError"))
        return bool(live)


# ---- the HTTP side -------------------------------------------------------------------------------
async def serve_choices(request: web.Request, router, request_id: str, parsed, fmt,
                        watch: Callable) -> web.StreamResponse:
    """/v1/completions or /v1/chat/completions with n > 1; `watch(request, group)` interrupts the
    wait when the client goes away (app.py's _ClientWatch)."""
    group = await router.submit_choices(request_id, parsed)
    try:
        if parsed.stream:
            return await _stream(request, group, fmt, watch)
        return await _collect(request, group, fmt, watch)
    finally:  # on finish a no-op but for the nodes' leftovers; on disconnect it aborts every choice
        await router.release_choices(group)


def _error_response(error: RouterError) -> web.Response:
    return web.json_response(error_body(error.message, error.status, type=error.type), status=error.status)


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _collect(request: web.Request, group: ChoiceGroup, fmt, watch: Callable) -> web.Response:
    for c in group.choices:
        c.wake_each_delta = False  # nothing to do before a choice ends
    n = len(group.choices)
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    watcher = watch(request, group)
    try:
        while None in finish:
            for i, delta in await group.wait_deltas():
                if delta.error is not None:
                    return _error_response(delta.error)
                texts[i].append(delta.text)
                logprobs[i].extend(delta.logprobs)
                finish[i] = delta.finish_reason or finish[i]
    finally:
        watcher.cancel()
    body, usage_ = None, group.usage()
    choices = []
    for i, choice_req in enumerate(group.choices):
        body = fmt.full("".join(texts[i]), finish[i], logprobs[i], usage_)
        choice = body["choices"][0]
        choice["index"] = i
        if fmt.return_token_ids:
            choice["token_ids"] = list(choice_req.output_token_ids)
        choices.append(choice)
    body["choices"] = choices
    return web.json_response(body)


async def _stream(request: web.Request, group: ChoiceGroup, fmt, watch: Callable) -> web.StreamResponse:
    """Each choice's chunks as the single-choice stream writes them, with its `index`; one
    `[DONE]` (after the usage chunk, when asked) once every choice has ended."""
    watcher = watch(request, group)
    try:
        items = await group.wait_deltas()
        error = next((d.error for _, d in items if d.error is not None), None)
        if error is not None:  # nothing sent yet: a real status
            return _error_response(error)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        n = len(group.choices)
        first, ended = [True] * n, [False] * n
        while True:
            events, done = [], False
            for i, delta in items:
                if delta.error is not None:
                    events.append(_event(error_body(delta.error.message, delta.error.status, type=delta.error.type)))
                    done = True
                    break
                for chunk in fmt.chunks(delta, first[i]):
                    for choice in chunk["choices"]:
                        choice["index"] = i
                    events.append(_event(chunk))
                first[i] = False
                ended[i] = ended[i] or delta.finish_reason is not None
            if not done and all(ended):
                if fmt.include_usage:
                    events.append(_event(fmt.usage_chunk(group.usage())))
                done = True
            if done:
                events.append(b"data: [DONE]\n\n")
            if events:
                await resp.write(b"".join(events))
            if done:
                break
            items = await group.wait_deltas()
        await resp.write_eof()
        return resp
    finally:
        watcher.cancel()

