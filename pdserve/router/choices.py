"""Parallel sampling (`n` > 1) at the router: one request, n choices.

The nodes run an n > 1 request as one prefill and one KV transfer under the request id, then as
n choices `{id}#{i}` (engine/request.py). The router holds one `RouterRequest` per choice under
those ids, so each re-sequences, detokenizes, checks its stop strings and ends on its own with
the code every request uses; a `ChoiceGroup` ties them together for the HTTP side (one wait for
any choice's deltas, chunks carrying each choice's `index`, usage summed over the choices).

    submit           one PrefillRequest for the request id (sampling with n); every choice is
                     placed on the same nodes under its own id
    heartbeats       before the fork the nodes list the request id alone: it stands for its
                     choices (`ChoiceGroups.listed` refreshes them; a request id no live choice stands
                     behind is aborted as any unknown id)
    errors           an Error for the request id applies to each of its choices
    re-dispatch      one choice alone: its next attempt is an n = 1 request `{id}#{i}~k` with the
                     choice's derived seed, so it continues as an undisturbed run would
    release          the HTTP side is done: every choice is released (aborting those not ended),
                     then, unless all ended normally, Abort(request id) clears what the nodes
                     still hold under it (a choice cannot be reached by its own id before the fork)

The HTTP side (app.py) serves every request through a `ChoiceGroup`: a request with n = 1 is a
group of one, never entered in the request table's groups.
"""

from __future__ import annotations

from pdserve.engine.request import child_id
from pdserve.protocol.messages import Error, PrefillRequest
from pdserve.router.choice_group import ChoiceGroup
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.redispatch import Redispatcher
from pdserve.router.registry import Route
from pdserve.router.request_state import RouterError, RouterRequest, RouterRequestStatus
from pdserve.router.request_table import RequestTable


class ChoiceGroups:
    """The n > 1 requests: their submission, release, and what node messages about a request id
    mean for its choices. The groups themselves live in the request table."""

    def __init__(self, table: RequestTable, dispatcher: Dispatcher, redispatcher: Redispatcher, tokenizer) -> None:
        self.table = table
        self.dispatcher = dispatcher
        self.redispatcher = redispatcher
        self.tokenizer = tokenizer

    async def submit(self, request_id: str, parsed) -> ChoiceGroup:
        """Like `Router.submit`, for n > 1: one dispatch for every choice (raises ProtocolError)."""
        deadline, route = self.dispatcher.admit(parsed)
        n, sampling = parsed.sampling.n, parsed.sampling
        choices = [RouterRequest(child_id(request_id, i), parsed.prompt_token_ids, sampling.for_choice(i),
                                 self.tokenizer, deadline=deadline) for i in range(n)]
        group = ChoiceGroup(request_id, parsed, choices)
        self.table.add_group(group)
        if not await self._dispatch(group, route):
            for choice in choices:
                await self.redispatcher.redispatch(choice, f"prefill node {route.prefill.node_id} is unreachable")
        return group

    async def _dispatch(self, group: ChoiceGroup, route: Route) -> bool:
        first = group.choices[0]
        prompt = first.prompt_token_ids
        for i, choice in enumerate(group.choices):
            # the prompt is prefilled once: its tokens and blocks are counted with choice 0
            self.table.dispatched(choice, route, len(prompt) if i == 0 else 0)
        group.node_ids = first.node_ids
        msg = PrefillRequest(group.request_id, prompt, group.sampling.to_dict(), first.decode_node_id,
                             route.decode.register.kv_addr if route.decode else "",
                             arrival_time=first.timing.arrival_wall)
        return await self.dispatcher.send(route.prefill, msg)

    async def release(self, group: ChoiceGroup, reason: str = "client disconnected") -> None:
        """`release` of every choice, then Abort(request id) where the one dispatch went, unless all
        ended normally (a group of one, n = 1, was never dispatched as a group: `release` alone)."""
        # (before `release` marks the unfinished ones aborted)
        ended_early = any(c.status != RouterRequestStatus.FINISHED or c.stopped_by_router for c in group.choices)
        for choice in group.choices:
            await self.dispatcher.release(choice, reason)
        self.table.drop_group(group)
        if ended_early:
            await self.dispatcher.abort_on(group.node_ids, group.request_id, reason)

    def _live_choices(self, request_id: str, node_id: str) -> list[RouterRequest]:
        """The choices of n > 1 request `request_id` whose current attempt is the one dispatch,
        on `node_id`, not ended: what the nodes hold under the request id stands for them."""
        group = self.table.group(request_id)
        if group is None:
            return []
        return [c for c in group.choices if c.attempt == 0 and not c.status.is_done and node_id in c.node_ids]

    def listed(self, node_id: str, request_id: str, now: float) -> bool:
        """A heartbeat of `node_id` lists `request_id`: True (and its choices count as listed) when
        it is an n > 1 request still dispatched there."""
        live = self._live_choices(request_id, node_id)
        for choice in live:
            choice.last_listed = now
        return bool(live)

    async def on_error(self, msg: Error) -> bool:
        """An Error for an n > 1 request id applies to each choice there; False when it is none."""
        live = self._live_choices(msg.request_id, msg.node_id)
        for choice in live:
            if msg.retryable:
                await self.redispatcher.redispatch(choice, f"node {msg.node_id}: {msg.message}")
            else:
                await self.dispatcher.fail(choice, RouterError(f"node {msg.node_id}: {msg.message}", 500,
                                                               "InternalServerError"))
        return bool(live)
