"""How a request's KV gets from a prefill node's pool into ours: one small interface, one file per way.

    transport.open(peer_layout, send)              at handshake: a handle for this peer, or None
        └─ transport.start(handle, ready, dst_block_ids)         the decode node's pull()
              ├─ DONE / FAILED      a copy that finished at once (shared memory, CUDA IPC)
              └─ PENDING            the data comes later as a KVData message (ZMQ pull)
                   └─ transport.on_data(handle, ready, dst_block_ids, data, frames) ─▶ DONE / FAILED

The implementations, in the receiver's order of preference (`receiver.TRANSPORTS`):

    "shm"        shm.SharedMemoryTransport    same host, CPU: map the peer ranks' /dev/shm segments
    "cuda_ipc"   cuda_ipc.CudaIpcTransport    same host, GPU: map the peer ranks' pools by CUDA IPC handle
    "zmq"        zmq_pull.ZmqPullTransport    anywhere: KVPull, one raw payload frame per rank of ours back

Tensor parallelism: both pools may be split by KV head over ranks (kvtransfer.heads), with different
TP sizes. Our pool is a list of shards, rank r's pool holding its heads; a transfer fills every
shard with exactly its heads, from whichever peer ranks hold them, and is DONE only when every shard
has its part (one Outcome, so one KVDone per request). `Outcome.rank_bytes` says what each of our
ranks received. Without tensor parallelism there is one shard holding every head.

The receiver opens them in that order and keeps every handle up to and including the first
transport that does not read the peer's pool directly; ZMQ, last, accepts every peer. A transport
that reads the peer's pool (`reads_peer_pool`) can only be used while the peer's lease is
comfortably alive: the peer reuses the blocks once it expires, and only a message-based pull lets
it answer "no longer held". A new backend (RDMA through NIXL or UCX, say) is one file with a
subclass and one entry in `receiver.TRANSPORTS`; one that reads the peer's pool subclasses
`PeerPoolCopy` and only maps a peer rank's pool (`open_rank`). `name` labels the receiver's
per-transport counts.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pdserve.kvcache.shard import KVShard
from pdserve.kvtransfer.heads import Piece, as_shards, cover, rank_bytes_per_token
from pdserve.kvtransfer.payload import copy_tokens
from pdserve.protocol.messages import KVData, KVLayout, KVReady, Message

Send = Callable[[Message], bool]  # a message to this peer over the receiver's socket; False if it could not go


class TransferState(enum.Enum):
    PENDING = "pending"  # started; the outcome arrives later (on_data, or the receiver's timeout)
    DONE = "done"  # the request's KV is in our blocks, on every rank
    FAILED = "failed"


@dataclass(frozen=True)
class Outcome:
    state: TransferState
    error: str = ""  # FAILED: why
    num_bytes: int = 0  # DONE: payload bytes moved into our pool (every rank)
    rank_bytes: tuple[int, ...] = ()  # DONE: of which, into rank r's pool at r (empty: all into rank 0's)

    @classmethod
    def done(cls, num_bytes: int, rank_bytes: Sequence[int] = ()) -> Outcome:
        return cls(TransferState.DONE, num_bytes=num_bytes, rank_bytes=tuple(rank_bytes))

    @classmethod
    def failed(cls, error: str) -> Outcome:
        return cls(TransferState.FAILED, error=error)

    @classmethod
    def pending(cls) -> Outcome:
        return cls(TransferState.PENDING)


class KVTransport(ABC):
    """One way to move KV into our pool (`shards`, of `layout`; a plain tensor is one shard holding
    every head). Stateless per request: what a transfer needs is passed in (the peer's handle, its
    KVReady, our destination blocks, the same block ids on every rank)."""

    name: ClassVar[str]  # metrics label: "shm", "cuda_ipc", "zmq", ...
    reads_peer_pool: ClassVar[bool]  # copies straight out of the peer's memory (lease-sensitive)
    same_host: ClassVar[bool]  # a handle proves the peer runs on this host (HandshakeAck.same_host)

    def __init__(self, layout: KVLayout, shards: Sequence[KVShard] | torch.Tensor):
        self.layout = layout
        self.shards = as_shards(shards, layout.num_kv_heads)

    @property
    def kv_buffer(self) -> torch.Tensor:
        """Rank 0's pool (the whole pool without tensor parallelism)."""
        return self.shards[0].tensor

    def rank_bytes(self, num_tokens: int) -> list[int]:
        """What a transfer of `num_tokens` tokens moves into each of our ranks: exactly its heads."""
        return [num_tokens * rank_bytes_per_token(self.layout, s.num_heads) for s in self.shards]

    @abstractmethod
    def open(self, peer_layout: KVLayout, send: Send) -> Any | None:
        """The probe, once per peer at handshake: a handle for `start`, or None when this transport
        cannot reach the peer. Never raises for a peer it cannot reach."""

    @abstractmethod
    def start(self, handle: Any, ready: KVReady, dst_block_ids: list[int], first_block: int = 0) -> Outcome:
        """Move the request's tokens into `dst_block_ids` of our pool, or start to. `first_block`
        > 0: the decode node holds the first blocks already; `ready` and `dst_block_ids` are then
        the rest (the KVReady's blocks and tokens from that block on), and a transport that asks
        the peer for the data names it."""

    def on_data(self, handle: Any, ready: KVReady, dst_block_ids: list[int], data: KVData, frames: list
                ) -> Outcome:
        """A KVData for a PENDING transfer of this transport arrived."""
        return Outcome.failed(f"{self.name} transport got an unexpected KVData")


@dataclass
class PeerPools:
    """A PeerPoolCopy's handle: the peer ranks' pools mapped here (those the plan reads), and per
    rank of ours, the pieces of its heads and the peer rank each comes from."""

    pools: dict[int, torch.Tensor]  # peer rank → its pool
    head_starts: list[int]  # peer rank → its first head (model-wide)
    plan: list[list[Piece]]  # our rank → its heads, piece by piece


class PeerPoolCopy(KVTransport):
    """A transport whose handle is the peer's pool, mapped here: a transfer is a pool-to-pool copy
    per piece of the plan (payload.copy_tokens; one Triton launch per rank when both pools are on
    one GPU and hold the same heads), finished when it returns."""

    reads_peer_pool = True
    same_host = True

    @abstractmethod
    def open_rank(self, peer_layout: KVLayout, rank: int) -> torch.Tensor | None:
        """Map the pool of the peer's rank `rank` (peer_layout.ranks[rank]), or None."""

    def open(self, peer_layout: KVLayout, send: Send) -> PeerPools | None:
        ranges = [(r.head_start, r.head_end) for r in peer_layout.ranks]
        plan = [cover(s.head_start, s.head_end, ranges) for s in self.shards]
        pools = {}
        for rank in sorted({piece.rank for pieces in plan for piece in pieces}):
            pool = self.open_rank(peer_layout, rank)
            if pool is None:  # every rank we read from, or none: ZMQ then
                return None
            pools[rank] = pool
        return PeerPools(pools, [start for start, _ in ranges], plan)

    def start(self, handle: PeerPools, ready: KVReady, dst_block_ids: list[int], first_block: int = 0) -> Outcome:
        try:
            for shard, pieces in zip(self.shards, handle.plan, strict=True):
                for p in pieces:
                    src_start = handle.head_starts[p.rank]
                    copy_tokens(handle.pools[p.rank], ready.block_ids, shard.tensor, dst_block_ids, ready.num_tokens,
                                src_heads=(p.start - src_start, p.end - src_start),
                                dst_heads=(p.start - shard.head_start, p.end - shard.head_start))
        except (ValueError, RuntimeError) as e:
            return Outcome.failed(f"same-host copy failed ({self.name}): {e}")
        rank_bytes = self.rank_bytes(ready.num_tokens)
        return Outcome.done(sum(rank_bytes), rank_bytes)
