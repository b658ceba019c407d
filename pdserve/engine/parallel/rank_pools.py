"""Every rank's KV pool, as the node process places and maps it (executor.py) and a worker maps
its own (worker.py). CPU: rank r's pool is a SharedKVPool the node process creates, which worker r
maps by name (probe-checked). CUDA: worker r allocates on cuda:r and the node process maps it by
the worker's IPC handle. Both through the KV cache's own pool code (kvcache.shm_pool,
kvcache.cuda_pool), the same the KV hand-off maps a peer's pool with."""

from __future__ import annotations

import torch

from pdserve.engine.parallel.errors import TPStartupError
from pdserve.kvcache import cuda_pool, shm_pool


def create_shm_pool(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> shm_pool.SharedKVPool:
    try:
        return shm_pool.SharedKVPool.create(f"tp{rank}", shape, dtype)
    except OSError as e:
        raise ValueError(f"tensor parallelism on the CPU keeps each rank's KV pool in /dev/shm, which has no room "
                         f"for rank {rank}'s ({e}); lower --kv-cache-memory-gb or enlarge /dev/shm") from e


def map_shm_pool(shape: tuple[int, ...], dtype: torch.dtype, name: str, probe_token: str) -> torch.Tensor:
    """A worker's own pool: the shared-memory segment rank 0 made for it (probe-checked)."""
    pool = shm_pool.map_segment(name, probe_token, tuple(shape), dtype)
    if pool is None:
        raise RuntimeError(f"could not map the KV pool segment {name!r} made by rank 0")
    return pool


def export_cuda_pool(pool: torch.Tensor) -> dict:
    """What the node process needs to map a worker's CUDA pool (sent in the worker's reply)."""
    return {"cuda_ipc": cuda_pool.export_pool(pool), "device_uuid": cuda_pool.device_uuid(pool.device)}


def map_cuda_pool(rank: int, reply: dict, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Worker `rank`'s CUDA pool, mapped here through the IPC handle it sent (not run: no 2-GPU host)."""
    pool = cuda_pool.map_pool(reply.get("cuda_ipc") or {}, reply.get("device_uuid", ""), tuple(shape), dtype)
    if pool is None:
        raise TPStartupError(f"tensor-parallel rank {rank}'s KV pool did not map here through CUDA IPC", rank)
    return pool
