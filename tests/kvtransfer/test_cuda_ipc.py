"""The GPU same-host path: a second process maps a CUDA KV pool through its IPC handle (carried
as msgpack, never pickled) and reads the same bytes. Skipped without a GPU; the CPU counterpart
is the shared-memory path in test_transfer.py."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
import torch

from pdserve.protocol.messages import KVLayout, KVRank

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in gpu_check.sh)")]

SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, num_blocks=8)
_OWNER = """
import sys, msgpack, torch
from pdserve.kvtransfer.cuda_ipc import export_pool, device_uuid
pool = torch.arange(2 * 2 * 8 * 16 * 2 * 16, dtype=torch.float32, device="cuda").view(2, 2, 8, 16, 2, 16)
sys.stdout.buffer.write(msgpack.packb({"info": export_pool(pool), "uuid": device_uuid(pool.device)}) + b"\\n")
sys.stdout.flush()
sys.stdin.readline()  # keep the pool alive until the parent has read it
"""


def test_a_peer_process_maps_the_pool_by_handle():
    from pdserve.kvtransfer.cuda_ipc import open_peer_pool

    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        msg = msgpack.unpackb(owner.stdout.readline()[:-1], raw=False)
        rank = KVRank(0, 2, device_uuid=msg["uuid"], cuda_ipc=msg["info"])
        layout = KVLayout(model="m", dtype="float32", **SHAPE, ranks=[rank])
        pool = open_peer_pool(layout)
        assert pool is not None
        want = torch.arange(pool.numel(), dtype=torch.float32, device=pool.device).view(pool.shape)
        assert torch.equal(pool, want)
        wrong = KVLayout(model="m", dtype="float32", **SHAPE,
                         ranks=[KVRank(0, 2, device_uuid="GPU-nope", cuda_ipc=msg["info"])])
        assert open_peer_pool(wrong) is None
    finally:
        owner.stdin.write(b"\n")
        owner.stdin.flush()
        owner.wait(30)
