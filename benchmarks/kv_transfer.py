"""KV hand-off bandwidth on one GPU: a request's blocks copied pool to pool by the one-pass
Triton kernel (what a decode node does after mapping the prefill pool by CUDA IPC), against
torch `index_select` + `index_copy_`, in the same run. Payload = K and V of every layer.

    python benchmarks/kv_transfer.py --json out.json    # defaults: Llama-3.2-1B shape, 2048 tokens
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from pdserve.bench.json_out import report


def _time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=2048)
    p.add_argument("--src-block-size", type=int, default=16)
    p.add_argument("--dst-block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kv_transfer.py measures GPU bandwidth: no CUDA device here", file=sys.stderr)
        return 2
    from pdserve.kernels.triton_cache import copy_tokens_triton
    from pdserve.kvtransfer.payload import slot_ids

    dev, dtype = torch.device("cuda"), torch.bfloat16
    n, L, H, D = args.num_tokens, args.num_layers, args.num_kv_heads, args.head_dim
    blocks = lambda bs: 4 * (-(-n // bs))  # noqa: E731 (pools 4x the request, blocks scattered)
    src = torch.randn(L, 2, blocks(args.src_block_size), args.src_block_size, H, D, dtype=dtype, device=dev)
    dst = torch.zeros(L, 2, blocks(args.dst_block_size), args.dst_block_size, H, D, dtype=dtype, device=dev)
    src_ids = torch.randperm(src.shape[2])[: -(-n // args.src_block_size)].tolist()
    dst_ids = torch.randperm(dst.shape[2])[: -(-n // args.dst_block_size)].tolist()
    payload = L * 2 * n * H * D * dtype.itemsize

    t_triton = _time(lambda: copy_tokens_triton(src, src_ids, dst, dst_ids, n), args.repeats)
    src_flat, dst_flat = src.view(L * 2, -1, H * D), dst.view(L * 2, -1, H * D)
    s_slots = slot_ids(src_ids, args.src_block_size, n, dev)
    d_slots = slot_ids(dst_ids, args.dst_block_size, n, dev)
    t_torch = _time(lambda: dst_flat.index_copy_(1, d_slots, src_flat.index_select(1, s_slots)), args.repeats)
    want = src_flat.index_select(1, s_slots)
    ok = torch.equal(dst_flat.index_select(1, d_slots), want)
    result = {"payload_bytes": payload, "triton_s": t_triton, "torch_s": t_torch,
              "triton_TBps": payload / t_triton / 1e12, "torch_TBps": payload / t_torch / 1e12, "bytes_identical": ok,
              "args": vars(args)}
    report(result, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
