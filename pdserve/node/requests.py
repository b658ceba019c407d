"""What a node process holds for each request: one table, `NodeRequests`, whatever the role.

It is the one place that answers "what do I hold for request X" (its stage, where its KV goes or
came from, the router it came from, its timings) and the one place a request is forgotten, on
every path: finished, aborted, refused, failed, its lease released, its router gone. The engine's
scheduler keeps its own `Request` objects and the KV sender and receiver their protocol state; a
node admits a request here when it takes it and forgets it here when it lets it go, so an entry
lives exactly as long as the node holds anything for the request.

    RECEIVED ──admit──▶ PREFILLING ─┬─▶ HANDED_OFF (blocks under a lease) ──lease released──▶ forgotten
      (a router sent it;            ├─▶ COLOCATED (decoding here: a colocated prefill node's, or
                                    │    a decode node's local prefill) ──finished / aborted─▶ forgotten
       its origin noted)            └─ finished with its first token, aborted ─────────────▶ forgotten
      └─ refused (queue full, bad parameters) ─────────────────────────────────────────────▶ forgotten

    (a decode node) admit ──▶ WAITING_FOR_KV ─▶ RECEIVING_KV ─▶ DECODING ──finished / aborted──▶ forgotten
                               └─ refused, transfer failed, aborted ───────────────────────────▶ forgotten

n > 1: once a request forks, each choice `{id}#{i}` has an entry of its own (`parent_id` = the
request id), so that an abort of the request id finds every choice (`family`).

The router links write origins here (`set_origin`, `orphan`): a request's router goes with its
entry. The status thread reads only `num` and `recent`, which the loop never iterates.
"""

from __future__ import annotations

import enum
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

RECENT_TIMINGS = 1024  # timing records kept for the status endpoint


class Stage(str, enum.Enum):
    RECEIVED = "received"  # a router sent it; the node has not taken it (yet)
    PREFILLING = "prefilling"  # in the engine, before its first token (a prefill node's, or a local prefill)
    COLOCATED = "colocated"  # decoding where it was prefilled (--role both, a decode node's local prefill)
    HANDED_OFF = "handed_off"  # prefill node: out of the engine, its blocks pinned under a lease
    WAITING_FOR_KV = "waiting_for_kv"  # decode node: announced, waiting for blocks
    RECEIVING_KV = "receiving_kv"  # decode node: blocks allocated, its KV being pulled in
    DECODING = "decoding"  # decode node: in the running batch


@dataclass
class HeldRequest:
    request_id: str
    stage: Stage
    origin: str = ""  # the router it came from ("" unknown: every router's)
    parent_id: str | None = None  # a choice of an n > 1 request: that request's id
    handoff: Any = None  # prefill node: its PrefillRequest (where its KV goes, its sampling)
    kv_ready: Any = None  # the KVReady: sent (prefill node, it names the pinned blocks) or received (decode node)
    timings: dict[str, Any] | None = None  # its record in `recent`, once it has one

    @property
    def block_ids(self) -> list[int]:
        """The prefill node's blocks the hand-off names (pinned there until the lease ends)."""
        return list(self.kv_ready.block_ids) if self.kv_ready is not None else []


class NodeRequests:
    def __init__(self, recent: int = RECENT_TIMINGS) -> None:
        self._entries: dict[str, HeldRequest] = {}
        self._counts: Counter[Stage] = Counter()
        self.recent: deque[dict[str, Any]] = deque(maxlen=recent)  # timing records, newest last

    # ---- asking ---------------------------------------------------------------------------
    def get(self, request_id: str) -> HeldRequest | None:
        return self._entries.get(request_id)

    def stage(self, request_id: str) -> Stage | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.stage

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def held_ids(self) -> list[str]:
        """The requests this node took (what its heartbeats list), in the order it took them."""
        return [rid for rid, e in self._entries.items() if e.stage is not Stage.RECEIVED]

    def num(self, stage: Stage) -> int:
        """How many are at `stage` (safe from another thread)."""
        return self._counts[stage]

    def family(self, request_id: str) -> list[str]:
        """`request_id` if held, and every choice held under it."""
        return [rid for rid, e in self._entries.items() if rid == request_id or e.parent_id == request_id]

    # ---- origins (the router links) ---------------------------------------------------------
    def origin(self, request_id: str) -> str:
        entry = self._entries.get(request_id)
        return "" if entry is None else entry.origin

    def set_origin(self, request_id: str, router_addr: str) -> None:
        """`request_id` came from `router_addr` (noted before the node takes it, if it does)."""
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._add(HeldRequest(request_id, Stage.RECEIVED))
        entry.origin = router_addr

    def orphan(self, router_addr: str) -> list[str]:
        """The router at `router_addr` is gone: its requests' origin becomes unknown; returns them."""
        gone = [e for e in self._entries.values() if e.origin == router_addr]
        for entry in gone:
            entry.origin = ""
        return [e.request_id for e in gone]

    # ---- taking and letting go --------------------------------------------------------------
    def admit(self, request_id: str, stage: Stage, **fields: Any) -> HeldRequest:
        """The node takes `request_id` at `stage` (its origin kept if noted already). Raises
        ValueError if it holds it already."""
        if stage is Stage.RECEIVED:
            raise ValueError("a request is admitted at a stage past RECEIVED")
        entry = self._entries.get(request_id)
        if entry is None:
            entry = self._add(HeldRequest(request_id, Stage.RECEIVED))
        elif entry.stage is not Stage.RECEIVED:
            raise ValueError(f"request {request_id!r} is already held ({entry.stage.value})")
        self.move(request_id, stage, **fields)
        return entry

    def move(self, request_id: str, stage: Stage, **fields: Any) -> HeldRequest:
        """`request_id` is at `stage` now (KeyError if not held); `fields` set on its entry."""
        entry = self._entries[request_id]
        self._counts[entry.stage] -= 1
        self._counts[stage] += 1
        entry.stage = stage
        for name, value in fields.items():
            if not hasattr(entry, name):
                raise TypeError(f"HeldRequest has no field {name!r}")
            setattr(entry, name, value)
        return entry

    def forget(self, request_id: str) -> HeldRequest | None:
        """Let `request_id` go (and its origin with it); None if it was not here."""
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._counts[entry.stage] -= 1
        return entry

    def forget_unadmitted(self, request_id: str) -> None:
        """A request the node did not take (refused): forgotten unless it holds it already."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.stage is Stage.RECEIVED:
            self.forget(request_id)

    def _add(self, entry: HeldRequest) -> HeldRequest:
        self._entries[entry.request_id] = entry
        self._counts[entry.stage] += 1
        return entry

    # ---- timings ----------------------------------------------------------------------------
    def log(self, request_id: str, timings: dict[str, Any]) -> dict[str, Any]:
        """Add a timing record for `request_id` to `recent`; later `note`s go into it while it is held."""
        record = {"request_id": request_id, **timings}
        self.recent.append(record)
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.timings = record
        return record

    def note(self, request_id: str, event: str, at: float | None = None) -> None:
        """Stamp `event` (wall clock) in the request's timing record, if it has one."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.timings is not None:
            entry.timings[event] = time.time() if at is None else at


def table_of(link) -> NodeRequests:
    """The request table a node keeps: its router links' (`RouterLinks.requests`, where they note
    origins), or a table of its own (one `RouterLink`: every request is that router's)."""
    table = getattr(link, "requests", None)
    return table if table is not None else NodeRequests()
