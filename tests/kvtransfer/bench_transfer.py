"""KV hand-off throughput for one 2048-token request of the SmolLM2-135M shape (30 layers, 3 KV
heads, head dim 64, bf16): ZMQ over tcp loopback and the shared-memory path, sender and receiver in
one process (so the two ends share a core: a lower bound). Run: python -m tests.kvtransfer.bench_transfer"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.kvtransfer.messages import KVLayout, KVReady
from pdserve.kvtransfer.payload import DTYPES, copy_tokens, gather_tokens, scatter_tokens
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm import SharedKVPool, layout_shape


def layout(block_size: int, num_blocks: int) -> KVLayout:
    return KVLayout(model="smollm2", dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64,
                    block_size=block_size, num_blocks=num_blocks)


def wait(sender, receiver, request_id: str, kind: str) -> None:
    while True:
        sender.poll(0)
        for event in receiver.poll(1):
            if event.request_id == request_id and event.kind == kind:
                return
            if event.request_id == request_id and event.kind == "failed":
                raise RuntimeError(f"{request_id} failed: {event.error}")


def run(shm: bool, num_tokens: int, src_bs: int, dst_bs: int, reps: int) -> float:
    src_layout, dst_layout = layout(src_bs, 2 * num_tokens // src_bs), layout(dst_bs, 2 * num_tokens // dst_bs)
    pool = SharedKVPool.create("bench", layout_shape(src_layout), torch.bfloat16) if shm else None
    src = pool.tensor if pool else torch.empty(layout_shape(src_layout), dtype=torch.bfloat16)
    src.copy_(torch.randn(src.shape).to(torch.bfloat16))
    sender = KVSender("p", src_layout, src, lambda rid: None, shm_pool=pool)
    receiver = KVReceiver("d", dst_layout, torch.zeros(layout_shape(dst_layout), dtype=torch.bfloat16))
    num_blocks = num_tokens // src_bs
    times = []
    for i in range(reps + 1):
        rid = f"r{i}"
        src_ids = list(range(num_blocks - 1, -1, -1))  # reversed: no accidental contiguity
        sender.send("d", receiver.kv_addr, KVReady(rid, [], 0, None, {}, num_tokens, src_ids, src_bs, 30.0))
        wait(sender, receiver, rid, "ready")
        t0 = time.perf_counter()
        receiver.pull(rid, list(range(0, 2 * num_tokens // dst_bs, 2))[: num_tokens // dst_bs])
        wait(sender, receiver, rid, "done")
        times.append(time.perf_counter() - t0)
    assert (receiver.num_shm_copies > 0) == shm
    sender.close()
    receiver.close()
    if pool:
        pool.close()
    return min(times[1:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    nbytes = 30 * 2 * args.tokens * 3 * 64 * DTYPES["bfloat16"].itemsize
    print(f"torch threads {torch.get_num_threads()}; payload {nbytes / 1e6:.1f} MB")
    for shm in (False, True):
        for src_bs, dst_bs in ((16, 16), (16, 8)):
            s = run(shm, args.tokens, src_bs, dst_bs, args.reps)
            print(f"{'shm' if shm else 'zmq'} {src_bs}->{dst_bs}: {s * 1e3:7.1f} ms  {nbytes / s / 1e6:8.0f} MB/s")
    pool = torch.randn(30, 2, 256, 16, 3, 64).to(torch.bfloat16)
    dst = torch.zeros_like(pool)
    ids = list(range(127, -1, -1))
    payload = gather_tokens(pool, ids, args.tokens)
    for name, fn in (("gather", lambda: gather_tokens(pool, ids, args.tokens)),
                     ("scatter", lambda: scatter_tokens(dst, ids, payload)),
                     ("copy_tokens", lambda: copy_tokens(pool, ids, dst, ids, args.tokens))):
        fn()
        t0 = time.perf_counter()
        for _ in range(args.reps):
            fn()
        s = (time.perf_counter() - t0) / args.reps
        print(f"{name:12s} {s * 1e3:7.1f} ms  {nbytes / s / 1e6:8.0f} MB/s")


if __name__ == "__main__":
    main()
