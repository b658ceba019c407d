"""The same-host fast path on GPUs: a decode node maps the prefill node's CUDA KV pool through a
CUDA IPC handle and copies a request's blocks device to device (one Triton launch), no host hop.

The handle travels in the handshake's `KVLayout.ranks[r].cuda_ipc` as plain msgpack values (ints
and bytes: what `UntypedStorage._share_cuda_` returns), never pickled; with tensor parallelism
there is one per rank's pool. "Same host" is decided by the probe: each peer rank's device UUID
names a device visible here and its handle opens; otherwise the decode node pulls over ZMQ.
`CudaIpcTransport` ("cuda_ipc") is the receiver's side (kvtransfer.transport); `advertise` is the
sender's: it puts a rank's handle in the handshake.

A rank > 0's pool lives in its worker process and the node process maps it by the worker's handle;
CUDA does not let a process export memory it imported, so that rank is advertised with the
worker's own export (`KVShard.cuda_ipc`, when the shard carries it); without it, the peer pulls
over ZMQ. (No multi-GPU machine here: the TP > 1 part of this path is written, not run.)
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pdserve.kvcache.cuda_pool import device_uuid, export_pool, map_pool
from pdserve.kvcache.shard import KVShard
from pdserve.kvtransfer.heads import rank_shape
from pdserve.kvtransfer.payload import DTYPES
from pdserve.kvtransfer.transport import PeerPoolCopy
from pdserve.protocol.messages import KVLayout, KVRank

log = logging.getLogger(__name__)


def advertise(entry: KVRank, shard: KVShard) -> KVRank:
    """`entry` (the shard's rank in the handshake) plus what a same-host peer needs to map the
    shard's pool; unchanged for a CPU pool, or for a pool whose handle cannot be exported here."""
    pool = shard.tensor
    if not pool.is_cuda:
        return entry
    info = getattr(shard, "cuda_ipc", None)  # a worker's own export of its pool
    if not info:
        try:
            info = export_pool(pool)
        except RuntimeError as e:  # memory this process imported (another rank's): not exportable
            log.info("rank %d's KV pool has no CUDA IPC handle to advertise (%s): peers pull over ZMQ",
                     shard.rank, e)
            return entry
    return dataclasses.replace(entry, device_uuid=device_uuid(pool.device), cuda_ipc=info)


def open_peer_pool(layout: KVLayout, rank: int = 0) -> torch.Tensor | None:
    """Map the pool of the peer's rank `rank` if its device is visible here and its handle opens;
    else None."""
    if not 0 <= rank < len(layout.ranks) or layout.dtype not in DTYPES:
        return None
    entry = layout.ranks[rank]
    pool = map_pool(entry.cuda_ipc, entry.device_uuid, rank_shape(layout, entry), DTYPES[layout.dtype])
    if pool is None and entry.cuda_ipc and entry.device_uuid:
        log.info("no CUDA IPC mapping of %s rank %d here: pulling over ZMQ", layout.model, rank)
    return pool


class CudaIpcTransport(PeerPoolCopy):
    """Same host, GPU pools: the handle holds the peer ranks' pools mapped by their CUDA IPC handles."""

    name = "cuda_ipc"

    def open_rank(self, peer_layout: KVLayout, rank: int) -> torch.Tensor | None:
        return open_peer_pool(peer_layout, rank)
