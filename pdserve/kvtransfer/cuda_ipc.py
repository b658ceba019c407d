"""The same-host fast path on GPUs: a decode node maps the prefill node's CUDA KV pool through a
CUDA IPC handle and copies a request's blocks device to device (one Triton launch), no host hop.

The handle travels in the handshake's `KVLayout.cuda_ipc` as plain msgpack values (ints and
bytes: what `UntypedStorage._share_cuda_` returns), never pickled. "Same host" is decided by the
probe: the peer's device UUID names a device visible here and the handle opens; otherwise the
decode node pulls over ZMQ. `CudaIpcTransport` ("cuda_ipc") is the receiver's side
(kvtransfer.transport); `advertise` is the sender's: it puts the handle in the handshake.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from pdserve.kvtransfer.layout import layout_shape
from pdserve.kvtransfer.messages import KVLayout
from pdserve.kvtransfer.payload import DTYPES
from pdserve.kvtransfer.transport import PeerPoolCopy, Send

log = logging.getLogger(__name__)

_FIELDS = ("device", "handle", "size", "offset", "ref_handle", "ref_offset", "event_handle", "event_sync")


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def export_pool(pool: torch.Tensor) -> dict:
    """What a peer process needs to map `pool` (a CUDA tensor owned by this process)."""
    shared = pool.untyped_storage()._share_cuda_()
    info = dict(zip(_FIELDS, shared, strict=True))
    info["storage_offset"] = pool.storage_offset()
    return info


def advertise(layout: KVLayout, pool: torch.Tensor) -> KVLayout:
    """`layout` plus what a same-host peer needs to map `pool` (unchanged for a CPU pool)."""
    if not pool.is_cuda:
        return layout
    return dataclasses.replace(layout, device_uuid=device_uuid(pool.device), cuda_ipc=export_pool(pool))


def open_peer_pool(layout: KVLayout) -> torch.Tensor | None:
    """Map the peer's pool if its device is visible here and its handle opens; else None."""
    info = layout.cuda_ipc
    if not info or not layout.device_uuid or layout.dtype not in DTYPES or not torch.cuda.is_available():
        return None
    index = next((i for i in range(torch.cuda.device_count())
                  if device_uuid(torch.device("cuda", i)) == layout.device_uuid), None)
    if index is None:
        return None
    try:
        args = [info[f] for f in _FIELDS]
        args[0] = index  # the device as numbered in this process
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(*args)
            pool = torch.empty(0, dtype=DTYPES[layout.dtype], device=f"cuda:{index}")
            pool.set_(storage, int(info["storage_offset"]), layout_shape(layout))
    except (KeyError, TypeError, RuntimeError) as e:
        log.info("CUDA IPC handle of %s did not open here (%s): pulling over ZMQ", layout.model, e)
        return None
    return pool


class CudaIpcTransport(PeerPoolCopy):
    """Same host, GPU pools: the handle is the peer's pool mapped by its CUDA IPC handle."""

    name = "cuda_ipc"

    def open(self, peer_layout: KVLayout, send: Send) -> torch.Tensor | None:
        return open_peer_pool(peer_layout)
