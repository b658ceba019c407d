"""One rank's part of a node's KV pool, as the node process sees it.

With tensor parallelism each rank holds the KV of its own KV heads only: rank r's pool is
``[num_layers, 2, num_blocks, block_size, head_end - head_start, head_dim]`` and covers the
model's KV heads ``[head_start, head_end)``. Block ids are the same on every rank (one block
manager per node). The node process (rank 0) maps every rank's pool, so the KV hand-off reads and
writes each rank's heads there. Without tensor parallelism a node has one shard covering every head.
When the TP size exceeds the KV heads, several ranks hold the same head (replicas).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVShard:
    rank: int
    head_start: int  # first KV head this rank holds (model-wide index)
    head_end: int  # one past its last
    tensor: torch.Tensor  # [num_layers, 2, num_blocks, block_size, head_end - head_start, head_dim]
    shm: object | None = None  # kvcache.shm_pool.SharedKVPool backing `tensor`, when it is in /dev/shm
    cuda_ipc: dict | None = None  # CUDA, rank > 0: the worker's own IPC export of its pool (kvtransfer.cuda_ipc)

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start
