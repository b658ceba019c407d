"""The scheduler's decision for one step: the only thing the model runner sees (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from pdserve.engine.decode_batch import DecodeStep
from pdserve.engine.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_computed_tokens: int  # KV already in the blocks; this step's tokens start at this position
    num_new_tokens: int  # request.all_token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]
    block_ids: list[int]  # the request's block table (logical → physical), shared with the block manager
    samples: bool  # the chunk reaches the last known token: its logits give the next token
    # Speculative decoding: slots allocated past the last token for draft tokens (0 = none), and the
    # drafts themselves (at most that many), set by the proposer between schedule and the forward
    # (an empty tuple until then: no list built per request and step when nothing drafts).
    num_lookahead_tokens: int = 0
    spec_token_ids: Sequence[int] = ()


@dataclass
class SchedulerOutput:
    items: list[ScheduledRequest] = field(default_factory=list)  # batch order (read `scheduled`)
    # A step of the whole running batch decoding one token each, as columns (engine/decode_batch.py);
    # then `items` is empty until `scheduled` is read.
    decode: DecodeStep | None = None
    num_batched_tokens: int = 0  # sum of num_new_tokens
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), before the forward
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), after swap-outs
    # (src, dst) device copies, after the swap-outs and before the swap-ins: copy-on-write of blocks
    # that the choices of an n > 1 request share (read as they were at the start of the step)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    forked: dict[str, list[Request]] = field(default_factory=dict)  # set by postprocess: parent id → children
    stepped: list[Request] = field(default_factory=list)  # set by postprocess: requests given new tokens

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """The step's chunks, request by request (a decode step's built from its columns on first read)."""
        decode = self.decode
        if decode is not None and not self.items:
            self.items = list(map(ScheduledRequest, decode.requests, decode.positions.tolist(), repeat(1),
                                  decode.block_lists, repeat(True)))
        return self.items

    @property
    def is_empty(self) -> bool:
        return self.decode is None and not self.items

    def cancel_copies(self, block_ids: Iterable[int]) -> dict[int, int]:
        """Cancel the copy-on-writes into `block_ids` (a request preempted in the step they were
        made for: its copies are freed or swapped out); returns {dst: src} of those cancelled."""
        if not self.blocks_to_copy:
            return {}
        table = set(block_ids)
        undo = {dst: src for src, dst in self.blocks_to_copy if dst in table}
        if undo:
            self.blocks_to_copy = [(src, dst) for src, dst in self.blocks_to_copy if dst not in undo]
        return undo
