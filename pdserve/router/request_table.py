"""The router's one table of per-request state: every request it holds, by request id.

A request the router holds is either in flight (its current attempt was sent to nodes, which know
it by its wire id, request_state.py) or parked (its last attempt was lost and no node can take
the next one yet, redispatch.py). An n > 1 request is also a group of choices (choices.py), each
choice a request of its own under `{id}#{i}`.

    entry           the `RouterRequest` (its status, nodes, output, timing, outbox) and, while it
                    is parked, until when it may wait and why
    wire ids        the in-flight requests by the wire id of their current attempt: how a node
                    message finds its request (dispatch order)
    groups          the n > 1 requests' `ChoiceGroup`s, by request id, from submit to release
    node holdings   the registry's count of this router's requests on each node (prompt tokens
                    waiting for a first token, requests held), for routing; written only here

`forget` is the one call that drops a request: entry, wire id and node holdings together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from pdserve.router.registry import Registry, Route
from pdserve.router.request_state import RouterRequest

if TYPE_CHECKING:
    from pdserve.router.choice_group import ChoiceGroup


@dataclass
class Parked:
    """A request waiting for a node that can take its next attempt."""

    req: RouterRequest
    wait_until: float  # monotonic: it fails once no node took it by then
    reason: str  # why its last attempt was lost


@dataclass
class Entry:
    req: RouterRequest
    parked: Parked | None = None


class RequestTable:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._entries: dict[str, Entry] = {}  # request id → entry
        self._by_wire_id: dict[str, RouterRequest] = {}  # in flight: wire id → request, in dispatch order
        self._parked: dict[str, Parked] = {}  # request id → parked, in parking order
        self._groups: dict[str, ChoiceGroup] = {}  # n > 1: request id → its choices
        self.in_flight: Mapping[str, RouterRequest] = MappingProxyType(self._by_wire_id)  # read-only view
        self.parked: Mapping[str, Parked] = MappingProxyType(self._parked)
        self.groups: Mapping[str, ChoiceGroup] = MappingProxyType(self._groups)
        # attempt(wire_id): the in-flight request whose current attempt the nodes know as `wire_id`
        # (None: none). The dict's own lookup, called for every token that comes in.
        self.attempt: Callable[[str], RouterRequest | None] = self._by_wire_id.get

    # ---- what the router knows --------------------------------------------------------------
    def get(self, request_id: str) -> RouterRequest | None:
        entry = self._entries.get(request_id)
        return entry.req if entry is not None else None

    def entry(self, request_id: str) -> Entry | None:
        return self._entries.get(request_id)

    def __len__(self) -> int:
        """Requests held: in flight and parked."""
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def requests(self) -> Iterator[RouterRequest]:
        """Every request held: the in-flight ones (dispatch order), then the parked ones."""
        yield from list(self._by_wire_id.values())
        yield from [p.req for p in list(self._parked.values())]

    def group(self, request_id: str) -> ChoiceGroup | None:
        return self._groups.get(request_id)

    # ---- a request's moves --------------------------------------------------------------------
    def dispatched(self, req: RouterRequest, route: Route, prompt_len: int) -> None:
        """`req`'s current attempt goes to `route`: it is in flight under its wire id, and counts
        `prompt_len` prompt tokens on the prefill node until its first token."""
        req.mark_dispatched(route.prefill.node_id, route.decode.node_id if route.decode else "")
        self._entries[req.request_id] = Entry(req)
        self._by_wire_id[req.wire_id] = req
        self._registry.add_request(route, req.wire_id, prompt_len, req.attempt_sampling.max_tokens)

    def first_token(self, req: RouterRequest) -> None:
        """The current attempt's prefill is over: its prompt tokens leave the prefill node's load."""
        self._registry.first_token(req.prefill_node_id, req.wire_id)

    def park(self, req: RouterRequest, wait_until: float, reason: str) -> None:
        """`req` (forgotten when its last attempt was lost) waits for a node until `wait_until`."""
        parked = Parked(req, wait_until, reason)
        self._entries[req.request_id] = Entry(req, parked)
        self._parked[req.request_id] = parked

    def unpark(self, request_id: str) -> None:
        """A parked request leaves the table (to be dispatched again, or failed)."""
        if self._parked.pop(request_id, None) is not None:
            del self._entries[request_id]

    def forget(self, req: RouterRequest) -> None:
        """`req` ended, or its current attempt is lost: it leaves every part of the table."""
        entry = self._entries.get(req.request_id)
        if entry is not None and entry.req is req:
            del self._entries[req.request_id]
            self._parked.pop(req.request_id, None)
        if self._by_wire_id.get(req.wire_id) is req:
            del self._by_wire_id[req.wire_id]
        self._registry.release_request(req.node_ids, req.wire_id)

    # ---- n > 1 groups -------------------------------------------------------------------------
    def add_group(self, group: ChoiceGroup) -> None:
        self._groups[group.request_id] = group

    def drop_group(self, group: ChoiceGroup) -> None:
        if self._groups.get(group.request_id) is group:
            del self._groups[group.request_id]

    def check_invariants(self) -> None:
        """For tests: every entry is in flight under its current wire id or parked, not both."""
        for request_id, entry in self._entries.items():
            in_flight = self._by_wire_id.get(entry.req.wire_id) is entry.req
            parked = self._parked.get(request_id) is entry.parked and entry.parked is not None
            assert in_flight != parked, f"{request_id}: in flight {in_flight}, parked {parked}"
        assert len(self._by_wire_id) + len(self._parked) == len(self._entries)
