"""The shared-memory transport ("shm"): same host, CPU pools.

The prefill node's pool is a `kvcache.shm_pool.SharedKVPool`; its handshake names each rank's
segment and probe token in `KVLayout.ranks`. `SharedMemoryTransport` is the receiver's side
(kvtransfer.transport): its probe is `open_peer_pool`, once per prefill rank it reads from, and a
transfer copies each of our ranks' heads out of the mapped segments.
"""

from __future__ import annotations

import torch

from pdserve.kvcache.shm_pool import map_segment
from pdserve.kvtransfer.heads import rank_shape
from pdserve.kvtransfer.payload import DTYPES
from pdserve.kvtransfer.transport import PeerPoolCopy
from pdserve.protocol.messages import KVLayout


def open_peer_pool(layout: KVLayout, rank: int = 0) -> torch.Tensor | None:
    """Map the pool of the peer's rank `rank` if its segment is here, has the size `layout` implies
    for that rank's heads, and carries the rank's probe token; else None (never raises for a
    missing, foreign or mismatched segment)."""
    if not 0 <= rank < len(layout.ranks) or layout.dtype not in DTYPES:
        return None
    entry = layout.ranks[rank]
    return map_segment(entry.shm_name, entry.probe_token, rank_shape(layout, entry), DTYPES[layout.dtype])


class SharedMemoryTransport(PeerPoolCopy):
    """Same host, CPU pools: the handle holds the peer ranks' pools mapped from their segments."""

    name = "shm"

    def open_rank(self, peer_layout: KVLayout, rank: int) -> torch.Tensor | None:
        return open_peer_pool(peer_layout, rank)
