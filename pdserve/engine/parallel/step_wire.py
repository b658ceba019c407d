"""What rank 0 sends ranks 1..N-1 over ZMQ: each engine step, and the few start-up commands.

A message is one msgpack map of plain values (never pickle). Tensors travel as
``[dtype name, shape, raw little-endian bytes]``; only the integer dtypes a step holds are allowed.

    {"op": "step", "batch": {...} | None, "compute_logits": bool,
     "swap_out": [[dev, host], ...], "copy": [[src, dst], ...], "swap_in": [[host, dev], ...]}
    {"op": "profile", ...} / {"op": "allocate", ...} / {"op": "stop"}    (executor.py, worker.py)

`Step` is the part of a `SchedulerOutput` every rank needs to run the same forward: the host
tensors of `ModelRunner.prepare_batch` (`HostBatch`), the block moves, and whether rank 0 computes
logits this step (the LM head's all-gather is a collective: every rank must join it or none).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, fields

import msgpack
import torch

_DTYPES = {"int32": torch.int32, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}
Pairs = list[tuple[int, int]]


@dataclass
class HostBatch:
    """One flattened batch on the host (what `ModelRunner.prepare_chunks` builds before upload)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with -1
    slot_mapping: torch.Tensor  # [T] int32
    logits_indices: torch.Tensor  # [L] int64: rows of the hidden states that get logits
    max_query_len: int
    max_seq_len: int


@dataclass
class Step:
    batch: HostBatch | None  # None: a step that only moves blocks (or does nothing)
    compute_logits: bool = False  # rank 0 computes logits (every rank joins the LM head's gather)
    blocks_to_swap_out: Pairs = field(default_factory=list)  # (device block, host block)
    blocks_to_copy: Pairs = field(default_factory=list)  # (source block, destination block)
    blocks_to_swap_in: Pairs = field(default_factory=list)  # (host block, device block)

    @property
    def is_noop(self) -> bool:
        return self.batch is None and not (self.blocks_to_swap_out or self.blocks_to_copy or self.blocks_to_swap_in)


def encode_step(step: Step) -> bytes:
    batch = None
    if step.batch is not None:
        batch = {f.name: _encode_value(getattr(step.batch, f.name)) for f in fields(HostBatch)}
    return encode_message({
        "op": "step", "batch": batch, "compute_logits": step.compute_logits,
        "swap_out": step.blocks_to_swap_out, "copy": step.blocks_to_copy, "swap_in": step.blocks_to_swap_in,
    })


def decode_step(message: dict) -> Step:
    """The Step of a decoded {"op": "step"} message."""
    batch = message["batch"]
    if batch is not None:
        batch = HostBatch(**{f.name: _decode_value(batch[f.name]) for f in fields(HostBatch)})
    return Step(batch, bool(message["compute_logits"]), _pairs(message["swap_out"]), _pairs(message["copy"]),
                _pairs(message["swap_in"]))


def encode_message(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode_message(data: bytes) -> dict:
    message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ValueError("a tensor-parallel message must be a map with an 'op'")
    return message


def _encode_value(value):
    if not isinstance(value, torch.Tensor):
        return int(value)
    if value.dtype not in _NAMES:
        raise ValueError(f"a step tensor must be int32 or int64, got {value.dtype}")
    if sys.byteorder != "little":  # every platform pdserve runs on; the wire is little-endian
        raise RuntimeError("tensor-parallel steps need a little-endian host")
    host = value.detach().to("cpu").contiguous()
    return [_NAMES[value.dtype], list(host.shape), host.numpy().tobytes()]


def _decode_value(value):
    if isinstance(value, int):
        return value
    name, shape, raw = value
    dtype = _DTYPES[name]
    numel = 1
    for n in shape:
        numel *= n
    if len(raw) != numel * dtype.itemsize:
        raise ValueError(f"a {name}{shape} tensor needs {numel * dtype.itemsize} bytes, got {len(raw)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(shape)


def _pairs(value) -> Pairs:
    return [(int(a), int(b)) for a, b in value]
