"""A CUDA KV pool shared between processes on one host through CUDA IPC handles.

`export_pool` gives what another process needs to map a pool this process owns, as plain msgpack
values (ints and bytes: what `UntypedStorage._share_cuda_` returns), never pickled; `map_pool`
maps such an export on the device with the same UUID. CUDA does not let a process export memory
it imported. The KV hand-off (kvtransfer.cuda_ipc) and the tensor-parallel ranks of one node
(engine.parallel) both share pools this way.
"""

from __future__ import annotations

import logging

import torch

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


def map_pool(info: dict, uuid: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The pool exported as `info` on the device whose UUID is `uuid`, viewed as `shape`, if that
    device is visible here and the handle opens; else None (logged)."""
    if not info or not uuid or not torch.cuda.is_available():
        return None
    index = next((i for i in range(torch.cuda.device_count()) if device_uuid(torch.device("cuda", i)) == uuid), None)
    if index is None:
        return None
    try:
        args = [info[f] for f in _FIELDS]
        args[0] = index  # the device as numbered in this process
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(*args)
            pool = torch.empty(0, dtype=dtype, device=f"cuda:{index}")
            pool.set_(storage, int(info["storage_offset"]), shape)
    except (KeyError, TypeError, RuntimeError) as e:
        log.info("CUDA IPC handle did not open here (%s)", e)
        return None
    return pool
