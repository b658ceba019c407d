"""Every message that crosses a socket: typed dataclasses, msgpack on the wire, never pickle.

A message is a msgpack map ``{"type": NAME, "version": PROTOCOL_VERSION, **fields}``. Decoding
checks the size before parsing, then the type, the version, and every field's presence and type;
anything malformed raises `MessageError`, which receivers log and drop. Tensor payloads never go
inside a message: they travel as separate ZMQ frames after a header message (`KVData`).

Who sends what (R = router, P = prefill node, D = decode node):

    P,D → R   Register, Heartbeat, Deregister
    R → P,D   PrefillRequest (a decode node takes one with no decode node named: it prefills locally)
    R → P,D   Abort, Reregister, SetRole
    P,D → R   FirstToken, TokenBatch, Error
    P,D → R   KVEvents (prefix-cache blocks stored and removed)     R → P,D   KVResync
    P → D     Handshake, KVReady, KVData     D → P     HandshakeAck, KVPull, LeaseRenew, KVDone
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import msgspec

PROTOCOL_VERSION = 3  # 2: TokenBatch as columns; 3: KV layouts per tensor-parallel rank
MAX_MESSAGE_BYTES = 16 << 20  # a control message; KV payload frames are bounded separately
MAX_TOKENS_PER_MESSAGE = 1 << 20
MAX_RANKS = 1024  # tensor-parallel ranks a KV layout or pull may name
MAX_STEP_SAMPLES = 64  # engine step samples one heartbeat may carry
MAX_KV_EVENTS = 1 << 20  # block keys one KVEvents may carry (a snapshot of a large pool is split)
KV_TIERS = ("memory", "disk")


class MessageError(ValueError):
    """A message that cannot be decoded or fails validation."""


@dataclass
class Message:
    TYPE: ClassVar[str] = ""

    def encode(self) -> bytes:
        return encode(self)

    def wire_error(self) -> str | None:
        """What is wrong with a decoded message beyond its fields' types (None: nothing)."""
        return None


# ---- node registry ----------------------------------------------------------------------
@dataclass
class Register(Message):
    TYPE: ClassVar[str] = "register"
    node_id: str
    role: str  # "prefill" | "decode" | "both" (colocated)
    model: str  # served model name
    kv_addr: str = ""  # decode: where prefill nodes connect to hand KV over
    metrics_url: str = ""
    num_total_blocks: int = 0
    block_size: int = 0
    max_model_len: int = 0  # prompt + output tokens a request may hold on this node
    host_id: str = ""  # same-host probing hint (never trusted alone)
    pid: int = 0
    max_num_seqs: int = 0  # requests the node runs at once (the router's queue limit counts beyond it)


@dataclass
class Heartbeat(Message):
    TYPE: ClassVar[str] = "heartbeat"
    node_id: str
    num_free_blocks: int
    num_total_blocks: int
    num_running: int
    num_waiting: int
    num_outstanding_tokens: int = 0  # prefill: prompt tokens queued or in progress
    ready: bool = True  # model loaded and warmed up
    request_ids: list[str] = field(default_factory=list)  # requests the node holds state for
    role: str = ""  # the role it serves now ("" from an older node: its Register's)
    # Engine steps since the last heartbeat, newest last, at most MAX_STEP_SAMPLES:
    # [prefill tokens, decode sequences, context tokens of those sequences, seconds]. The planner
    # fits each node's speed from them (router/speed.py).
    step_samples: list[list[float]] = field(default_factory=list)

    def wire_error(self) -> str | None:
        if len(self.step_samples) > MAX_STEP_SAMPLES or any(len(s) != 4 for s in self.step_samples):
            return f"step_samples: at most {MAX_STEP_SAMPLES} rows of 4 numbers"
        return None


@dataclass
class SetRole(Message):
    """Serve `role` from now on ("prefill" or "decode"): stop taking new requests, finish (or hand
    off) what the node holds, then register again with the new role, model still loaded."""

    TYPE: ClassVar[str] = "set_role"
    role: str
    reason: str = ""


@dataclass
class Deregister(Message):
    TYPE: ClassVar[str] = "deregister"
    node_id: str


@dataclass
class Reregister(Message):
    """The router does not know the node (it restarted, or dropped the node for missed
    heartbeats): register again. Whatever the node still holds, the router has re-dispatched or
    forgotten; the next heartbeat's request_ids tell it what to abort."""

    TYPE: ClassVar[str] = "reregister"
    reason: str = ""


# ---- KV events: what each node's prefix cache holds (router/kv_index.py) -------------------
@dataclass
class KVEvents(Message):
    """Prefix-cache blocks a node's `tier` now holds (`stored`) and no longer holds (`removed`),
    by their chained block keys (engine/block_manager.py), since its previous KVEvents to this
    router. The two lists are disjoint (the node sends each key's last state), so applying them
    in either order is exact. `reset`: a snapshot, `stored` is the whole tier (after a Register,
    or when the router asked with KVResync). `seq` counts the node's events; `prev_seq` is the
    `seq` of the previous KVEvents this router got, so a gap is seen and a snapshot asked for."""

    TYPE: ClassVar[str] = "kv_events"
    node_id: str
    seq: int
    prev_seq: int
    tier: str = "memory"  # "memory" (the KV pool), "disk" (the node's offload tier)
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    reset: bool = False
    sent_at: float = 0.0  # the node's time.time() when sent: the router measures staleness

    def wire_error(self) -> str | None:
        if self.tier not in KV_TIERS:
            return f"tier must be one of {', '.join(KV_TIERS)}"
        if self.seq < 0 or self.prev_seq < 0:
            return "seq and prev_seq must be >= 0"
        if len(self.stored) + len(self.removed) > MAX_KV_EVENTS:
            return f"at most {MAX_KV_EVENTS} block keys per message"
        return None


@dataclass
class KVResync(Message):
    """The router lost track of the node's cache (a gap in KVEvents): send snapshots."""

    TYPE: ClassVar[str] = "kv_resync"
    reason: str = ""


# ---- requests -----------------------------------------------------------------------------
@dataclass
class PrefillRequest(Message):
    TYPE: ClassVar[str] = "prefill_request"
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict  # SamplingParams.to_dict()
    decode_node_id: str = ""  # "" = colocated: the prefill node decodes the request itself
    decode_kv_addr: str = ""
    priority: int = 0
    arrival_time: float = 0.0  # router's clock (time.time()), for TTFT split by stage
    num_prior_output_tokens: int = 0  # a re-dispatch: the prompt ends with this many tokens already streamed


@dataclass
class FirstToken(Message):
    TYPE: ClassVar[str] = "first_token"
    request_id: str
    token_id: int
    logprobs: dict | None = None  # {token_id: logprob}
    finish_reason: str | None = None  # set when the first token already ends the request
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queued_s: float = 0.0  # time in the prefill queue
    prefill_s: float = 0.0  # admission to first token


@dataclass(slots=True)
class Token:
    """One output token of a request: not a message of its own; tokens travel in a TokenBatch."""

    request_id: str
    index: int  # position in the output: the first token (from prefill) is index 0
    token_id: int
    logprobs: dict | None = None  # {token_id: logprob}
    finish_reason: str | None = None


@dataclass
class TokenBatch(Message):
    """All tokens one step of a node produced, in one message, as columns: token i is
    (request_ids[i], indexes[i], token_ids[i], logprobs[i], finish_reasons[i]). Columns, not one
    map per token, because the router decodes every token a fleet streams: a column of ints is
    one msgpack array, validated in one pass. `logprobs` is empty when no token carries any;
    build one with `from_tokens`."""

    TYPE: ClassVar[str] = "token_batch"
    node_id: str
    request_ids: list[str]
    indexes: list[int]
    token_ids: list[int]
    finish_reasons: list[str | None]
    logprobs: list[dict | None] = field(default_factory=list)

    @classmethod
    def from_tokens(cls, node_id: str, tokens: list[Token]) -> TokenBatch:
        """The one way nodes build a batch (a node with several routers builds one per router)."""
        logprobs = [t.logprobs for t in tokens]
        return cls(node_id, [t.request_id for t in tokens], [t.index for t in tokens], [t.token_id for t in tokens],
                   [t.finish_reason for t in tokens], logprobs if any(lp is not None for lp in logprobs) else [])

    def __len__(self) -> int:
        return len(self.request_ids)

    def tokens(self) -> list[Token]:
        """The batch as one `Token` per row (tests and slow paths; the router reads the columns)."""
        logprobs = self.logprobs or [None] * len(self.request_ids)
        return [Token(*row) for row in zip(self.request_ids, self.indexes, self.token_ids, logprobs,
                                           self.finish_reasons)]

    def wire_error(self) -> str | None:
        n = len(self.request_ids)
        if not (len(self.indexes) == len(self.token_ids) == len(self.finish_reasons) == n):
            return "columns of different lengths"
        if self.logprobs and len(self.logprobs) != n:
            return "logprobs column of a different length"
        return None


@dataclass
class Abort(Message):
    TYPE: ClassVar[str] = "abort"
    request_id: str
    reason: str = ""


@dataclass
class Error(Message):
    TYPE: ClassVar[str] = "error"
    request_id: str
    node_id: str
    message: str
    retryable: bool = False  # the router may re-dispatch the request elsewhere


# ---- KV hand-off (prefill → decode) -----------------------------------------------------
@dataclass
class KVRank(Message):
    """One tensor-parallel rank's part of a KV pool: the model's KV heads [head_start, head_end)
    (a pool of ``head_end - head_start`` heads), and how a same-host peer maps it."""

    TYPE: ClassVar[str] = "kv_rank"
    head_start: int
    head_end: int
    shm_name: str = ""  # same-host fast path: the rank's shared-memory segment ("" = none)
    probe_token: str = ""  # hex; the segment must hold it, proving the peer maps the same memory
    device_uuid: str = ""  # CUDA device of the rank's pool ("" on CPU)
    cuda_ipc: dict = field(default_factory=dict)  # CUDA IPC handle of the rank's pool (kvtransfer.cuda_ipc)


@dataclass
class KVLayout(Message):
    """What a KV pool holds; peers must agree on everything but the block size and the tensor
    parallelism. `num_kv_heads` is the model's count; rank r's pool holds `ranks[r]`'s heads
    (kvtransfer.heads checks that they are `tp_size` ranges covering every head)."""

    TYPE: ClassVar[str] = "kv_layout"
    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    tp_size: int = 1
    ranks: list[KVRank] = field(default_factory=list)  # rank r at r; a node's sender/receiver fills it

    def incompatibility(self, other: KVLayout) -> str | None:
        for name in ("model", "dtype", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs: {getattr(self, name)!r} here, {getattr(other, name)!r} at the peer"
        return None


@dataclass
class Handshake(Message):
    TYPE: ClassVar[str] = "handshake"
    node_id: str  # the prefill node
    layout: KVLayout


@dataclass
class HandshakeAck(Message):
    TYPE: ClassVar[str] = "handshake_ack"
    node_id: str  # the decode node
    ok: bool
    error: str = ""
    same_host: bool = False  # the decode node mapped the prefill pool's segment


@dataclass
class KVReady(Message):
    TYPE: ClassVar[str] = "kv_ready"
    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    first_logprobs: dict | None
    sampling: dict
    num_tokens: int  # tokens whose KV is ready (the prompt)
    block_ids: list[int]  # the prefill node's blocks holding them, in order
    block_size: int
    lease_s: float  # the blocks stay pinned this long unless renewed
    priority: int = 0
    num_prior_output_tokens: int = 0  # as in PrefillRequest
    router: str = ""  # the router the request came from, as the nodes address it: its tokens go back there
    # n > 1 (parallel sampling): each choice's first token, choice i at i (first_token is choice 0's);
    # the decode node forks the request into choices `{request_id}#{i}` once the KV is in
    choice_first_tokens: list[int] = field(default_factory=list)
    choice_first_logprobs: list[dict | None] = field(default_factory=list)


@dataclass
class KVPull(Message):
    """Send the request's KV: one payload frame per head range, in order (one per decode rank,
    [start, end) of the model's KV heads); none named = every head in one frame. `first_block`:
    only the tokens from that block of the KVReady on (the decode node's prefix cache holds the
    blocks before it)."""

    TYPE: ClassVar[str] = "kv_pull"
    request_id: str
    head_ranges: list[list[int]] = field(default_factory=list)
    first_block: int = 0

    def wire_error(self) -> str | None:
        if self.first_block < 0:
            return "first_block must be >= 0"
        if len(self.head_ranges) > MAX_RANKS:
            return f"{len(self.head_ranges)} head ranges, at most {MAX_RANKS}"
        if any(len(r) != 2 for r in self.head_ranges):
            return "a head range is [start, end]"
        return None


@dataclass
class KVData(Message):
    """Header of a KV payload; frame i after it holds shapes[i] = [num_layers, 2, num_tokens,
    heads of the pull's range i, head_dim]."""

    TYPE: ClassVar[str] = "kv_data"
    request_id: str
    ok: bool
    dtype: str = ""
    shapes: list[list[int]] = field(default_factory=list)
    error: str = ""


@dataclass
class LeaseRenew(Message):
    TYPE: ClassVar[str] = "lease_renew"
    request_id: str


@dataclass
class KVDone(Message):
    TYPE: ClassVar[str] = "kv_done"
    request_id: str
    ok: bool = True  # False: the decode node gave up (abort, error); the blocks are released all the same
    error: str = ""


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Register, Heartbeat, Deregister, Reregister, SetRole, KVEvents, KVResync, PrefillRequest, FirstToken, TokenBatch, Abort, Error,
                KVRank, KVLayout, Handshake, HandshakeAck, KVReady, KVPull, KVData, LeaseRenew, KVDone)
}


# ---- encoding -----------------------------------------------------------------------------
def encode(msg: Message) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def _to_wire(msg: Message) -> dict:
    out = {"type": msg.TYPE, "version": PROTOCOL_VERSION}
    for name in _field_names(type(msg)):
        value = getattr(msg, name)
        if isinstance(value, Message):
            value = _to_wire(value)
        elif isinstance(value, list) and value and isinstance(value[0], Message):  # KVLayout.ranks
            value = [_to_wire(v) for v in value]
        out[name] = value
    return out


@functools.cache
def _field_names(cls: type[Message]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


# ---- decoding -----------------------------------------------------------------------------
# Two validators of one schema (the dataclasses above). The fast one is msgspec: a struct per
# message class, derived from the dataclass, decoded and type-checked in C, with no Python object
# per field. Anything it refuses goes through the slow one (`_from_wire`, plain Python over
# msgpack's output), which has the final word and says what is wrong in our words. Only one runs on
# a valid message (the fast one, which accepts nothing the slow one refuses: tests/kvtransfer check
# it), and every refusal reads the same whichever path found it.
def decode(data: bytes | memoryview) -> Message:
    """Bytes → a validated message; raises MessageError on anything malformed."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    if len(data) > MAX_TOKENS_PER_MESSAGE:
        # msgspec has no limit on a list's length; a message this small cannot hold a longer one
        # (an element takes at least a byte), a bigger one goes where msgpack enforces it.
        return _decode_slow(data)
    try:
        wire = _fast_decoder().decode(data)
    except Exception:  # msgspec.DecodeError / ValidationError: the slow path says what is wrong
        return _decode_slow(data)
    msg = _from_struct(wire)
    return msg if msg is not None else _decode_slow(data)


def _decode_slow(data: bytes | memoryview) -> Message:
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False, max_bin_len=MAX_MESSAGE_BYTES,
                              max_str_len=MAX_MESSAGE_BYTES, max_array_len=MAX_TOKENS_PER_MESSAGE,
                              max_map_len=MAX_TOKENS_PER_MESSAGE)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MessageError(f"not msgpack: {e}") from None
    return _from_wire(obj)


def _from_struct(wire: msgspec.Struct) -> Message | None:
    """The message a fast-decoded struct stands for; None when the slow path must judge it (a
    protocol version other than ours, here or in a nested message)."""
    if wire.version != PROTOCOL_VERSION:
        return None
    cls, nested = _STRUCT_CLASSES[type(wire)]
    values = msgspec.structs.astuple(wire)[:-1]  # the last field is `version`
    if nested:
        values = list(values)
        for i, is_list in nested:
            if is_list:
                values[i] = [_from_struct(v) for v in values[i]]
                if any(v is None for v in values[i]):
                    return None
            else:
                values[i] = _from_struct(values[i])
                if values[i] is None:
                    return None
    msg = cls(*values)
    error = msg.wire_error()
    if error is not None:
        raise MessageError(f"{cls.TYPE}: {error}")
    return msg


# struct → (class, (index, is a list) of each field holding nested messages)
_STRUCT_CLASSES: dict[type, tuple[type[Message], tuple[tuple[int, bool], ...]]] = {}


@functools.cache  # one struct per class, a nested message's included
def _struct_for(cls: type[Message]) -> type[msgspec.Struct]:
    """The msgspec struct mirroring `cls`: the same fields and types, `type` as its tag, `version`
    last, unknown fields refused."""
    fields, nested = [], []
    for i, (name, hint, required) in enumerate(_schema(cls)[0]):
        if _is_message(hint):
            hint, _ = _struct_for(hint), nested.append((i, False))
        elif typing.get_origin(hint) is list and _is_message(typing.get_args(hint)[0]):
            hint, _ = list[_struct_for(typing.get_args(hint)[0])], nested.append((i, True))
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        if required:
            fields.append((name, hint))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((name, hint, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((name, hint, f.default))
    fields.append(("version", Any, None))
    struct = msgspec.defstruct(f"Wire{cls.__name__}", fields, tag_field="type", tag=cls.TYPE,
                               forbid_unknown_fields=True)
    _STRUCT_CLASSES[struct] = (cls, tuple(nested))
    return struct


def _is_message(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Message)


@functools.cache
def _fast_decoder() -> msgspec.msgpack.Decoder:
    structs = tuple(_struct_for(cls) for cls in MESSAGE_TYPES.values())
    return msgspec.msgpack.Decoder(typing.Union[structs])  # noqa: UP007 (a tuple of types, not syntax)


def _from_wire(obj: Any) -> Message:
    if not isinstance(obj, dict):
        raise MessageError("a message must be a map")
    type_name = obj.get("type")
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {obj.get('type')!r}")
    if obj.get("version") != PROTOCOL_VERSION:
        raise MessageError(f"{cls.TYPE}: protocol version {obj.get('version')!r}, expected {PROTOCOL_VERSION}")
    fields, known = _schema(cls)
    kwargs = {}
    for name, hint, required in fields:
        if name in obj:
            kwargs[name] = _check(cls.TYPE, name, obj[name], hint)
        elif required:
            raise MessageError(f"{cls.TYPE}: missing field {name!r}")
    if not known.issuperset(obj):
        raise MessageError(f"{cls.TYPE}: unknown field(s) {sorted(set(obj) - known)}")
    msg = cls(**kwargs)
    error = msg.wire_error()
    if error is not None:
        raise MessageError(f"{cls.TYPE}: {error}")
    return msg


@functools.cache
def _schema(cls: type[Message]) -> tuple[tuple[tuple[str, Any, bool], ...], frozenset[str]]:
    """(name, resolved annotation, required) per field, and every key a message may carry. Built
    once per class: resolving string annotations (`typing.get_type_hints`) per message was most of
    the router's CPU time per streamed token."""
    hints = typing.get_type_hints(cls)
    fields = tuple((f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                   for f in dataclasses.fields(cls))
    return fields, frozenset(name for name, _, _ in fields) | {"type", "version"}


def _check(type_name: str, name: str, value: Any, hint: Any) -> Any:
    """Validate one field against its annotation (the few shapes the messages use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(type_name, name, value, inner)
    if isinstance(hint, type) and issubclass(hint, Message):
        msg = _from_wire(value)
        if not isinstance(msg, hint):
            raise MessageError(f"{type_name}.{name}: expected {hint.TYPE}, got {msg.TYPE}")
        return msg
    if origin is list:
        if not isinstance(value, list):
            raise MessageError(f"{type_name}.{name}: expected a list, got {type(value).__name__}")
        return [_check(type_name, name, v, args[0]) for v in value]
    expected = {float: (int, float), int: int, str: str, bool: bool, dict: dict}[origin or hint]
    if not isinstance(value, expected) or (hint in (int, float) and isinstance(value, bool)):
        raise MessageError(f"{type_name}.{name}: expected {getattr(hint, '__name__', hint)}, "
                           f"got {type(value).__name__}")
    return float(value) if hint is float else value
