"""How a request's KV gets from a prefill node's pool into ours: one small interface, one file per way.

    transport.open(peer_layout, send)              at handshake: a handle for this peer, or None
        └─ transport.start(handle, ready, dst_block_ids)         the decode node's pull()
              ├─ DONE / FAILED      a copy that finished at once (shared memory, CUDA IPC)
              └─ PENDING            the data comes later as a KVData message (ZMQ pull)
                   └─ transport.on_data(handle, ready, dst_block_ids, data, frames) ─▶ DONE / FAILED

The implementations, in the receiver's order of preference (`receiver.TRANSPORTS`):

    "shm"        shm.SharedMemoryTransport    same host, CPU: map the peer's /dev/shm segment
    "cuda_ipc"   cuda_ipc.CudaIpcTransport    same host, GPU: map the peer's pool by CUDA IPC handle
    "zmq"        zmq_pull.ZmqPullTransport    anywhere: KVPull, one raw payload frame back

The receiver opens them in that order and keeps every handle up to and including the first
transport that does not read the peer's pool directly; ZMQ, last, accepts every peer. A transport
that reads the peer's pool (`reads_peer_pool`) can only be used while the peer's lease is
comfortably alive: the peer reuses the blocks once it expires, and only a message-based pull lets
it answer "no longer held". A new backend (RDMA through NIXL or UCX, say) is one file with a
subclass and one entry in `receiver.TRANSPORTS`. `name` labels the receiver's per-transport counts.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from pdserve.kvtransfer.layout import bytes_per_token
from pdserve.kvtransfer.messages import KVData, KVLayout, KVReady, Message
from pdserve.kvtransfer.payload import copy_tokens

Send = Callable[[Message], bool]  # a message to this peer over the receiver's socket; False if it could not go


class TransferState(enum.Enum):
    PENDING = "pending"  # started; the outcome arrives later (on_data, or the receiver's timeout)
    DONE = "done"  # the request's KV is in our blocks
    FAILED = "failed"


@dataclass(frozen=True)
class Outcome:
    state: TransferState
    error: str = ""  # FAILED: why
    num_bytes: int = 0  # DONE: payload bytes moved into our pool

    @classmethod
    def done(cls, num_bytes: int) -> Outcome:
        return cls(TransferState.DONE, num_bytes=num_bytes)

    @classmethod
    def failed(cls, error: str) -> Outcome:
        return cls(TransferState.FAILED, error=error)

    @classmethod
    def pending(cls) -> Outcome:
        return cls(TransferState.PENDING)


class KVTransport(ABC):
    """One way to move KV into `kv_buffer` (our pool, of `layout`). Stateless per request: what a
    transfer needs is passed in (the peer's handle, its KVReady, our destination blocks)."""

    name: ClassVar[str]  # metrics label: "shm", "cuda_ipc", "zmq", ...
    reads_peer_pool: ClassVar[bool]  # copies straight out of the peer's memory (lease-sensitive)
    same_host: ClassVar[bool]  # a handle proves the peer runs on this host (HandshakeAck.same_host)

    def __init__(self, layout: KVLayout, kv_buffer: torch.Tensor):
        self.layout = layout
        self.kv_buffer = kv_buffer

    @abstractmethod
    def open(self, peer_layout: KVLayout, send: Send) -> Any | None:
        """The probe, once per peer at handshake: a handle for `start`, or None when this transport
        cannot reach the peer. Never raises for a peer it cannot reach."""

    @abstractmethod
    def start(self, handle: Any, ready: KVReady, dst_block_ids: list[int]) -> Outcome:
        """Move the request's tokens into `dst_block_ids` of our pool, or start to."""

    def on_data(self, handle: Any, ready: KVReady, dst_block_ids: list[int], data: KVData, frames: list
                ) -> Outcome:
        """A KVData for a PENDING transfer of this transport arrived."""
        return Outcome.failed(f"{self.name} transport got an unexpected KVData")


class PeerPoolCopy(KVTransport):
    """A transport whose handle is the peer's pool, mapped here: a transfer is one pool-to-pool copy
    (payload.copy_tokens; a Triton launch when both pools are on one GPU), finished when it returns."""

    reads_peer_pool = True
    same_host = True

    def start(self, handle: torch.Tensor, ready: KVReady, dst_block_ids: list[int]) -> Outcome:
        try:
            copy_tokens(handle, ready.block_ids, self.kv_buffer, dst_block_ids, ready.num_tokens)
        except (ValueError, RuntimeError) as e:
            return Outcome.failed(f"same-host copy failed ({self.name}): {e}")
        return Outcome.done(ready.num_tokens * bytes_per_token(self.layout))
