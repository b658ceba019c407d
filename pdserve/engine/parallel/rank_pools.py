"""Every rank's KV pool, as the node process places and maps it (executor.py) and a worker maps
its own (worker.py). CPU: rank r's pool is a SharedKVPool the node process creates, which worker r
maps by name (probe-checked). CUDA: worker r allocates on cuda:r and the node process maps it by
the worker's IPC handle. Both map through the KV hand-off's own code, with a one-rank KVLayout."""

from __future__ import annotations

import torch

from pdserve.engine.parallel.errors import TPStartupError
from pdserve.kvcache.dtypes import dtype_name


def create_shm_pool(rank: int, shape: tuple[int, ...], dtype: torch.dtype):
    from pdserve.kvtransfer.shm import SharedKVPool

    try:
        return SharedKVPool.create(f"tp{rank}", shape, dtype)
    except OSError as e:
        raise ValueError(f"tensor parallelism on the CPU keeps each rank's KV pool in /dev/shm, which has no room "
                         f"for rank {rank}'s ({e}); lower --kv-cache-memory-gb or enlarge /dev/shm") from e


def map_shm_pool(shape: tuple[int, ...], dtype: torch.dtype, name: str, probe_token: str) -> torch.Tensor:
    """A worker's own pool: the shared-memory segment rank 0 made for it (probe-checked)."""
    from pdserve.kvtransfer.shm import open_peer_pool

    pool = open_peer_pool(one_pool_layout(shape, dtype, shm_name=name, probe_token=probe_token), 0)
    if pool is None:
        raise RuntimeError(f"could not map the KV pool segment {name!r} made by rank 0")
    return pool


def map_cuda_pool(rank: int, reply: dict, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Worker `rank`'s CUDA pool, mapped here through the IPC handle it sent (not run: no 2-GPU host)."""
    from pdserve.kvtransfer import cuda_ipc

    layout = one_pool_layout(shape, dtype, device_uuid=reply.get("device_uuid", ""), cuda_ipc=reply.get("cuda_ipc") or {})
    pool = cuda_ipc.open_peer_pool(layout, 0)
    if pool is None:
        raise TPStartupError(f"tensor-parallel rank {rank}'s KV pool did not map here through CUDA IPC", rank)
    return pool


def one_pool_layout(shape: tuple[int, ...], dtype: torch.dtype, **entry):
    """A KVLayout of one pool of `shape` (its heads: shape[4]), so a rank's pool maps through the
    hand-off's own code (kvtransfer.shm / kvtransfer.cuda_ipc `open_peer_pool(layout, 0)`)."""
    from pdserve.protocol.messages import KVLayout, KVRank

    num_layers, _, num_blocks, block_size, num_heads, head_dim = shape
    return KVLayout(model="", dtype=dtype_name(dtype), num_layers=num_layers, num_kv_heads=num_heads,
                    head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, tp_size=1,
                    ranks=[KVRank(0, num_heads, **entry)])
