"""One call of the compiled decode attention (batch 16 x L tokens, the default model's heads), hot
(the same call repeated) and cold (a 256 MB write between calls, as a step's GEMMs evict the KV),
medians of 30:

    python benchmarks/results/decode_kernel/attention_call.py small    (L=270; env L sets another)
    python benchmarks/results/decode_kernel/attention_call.py huge     (the pool madvised for huge pages)

Recorded in benchmarks/RESULTS.md, issue 13 fourth part."""

import ctypes
import os
import statistics
import sys
import time

import torch

from pdserve.kernels import cpu_native

MADV_HUGEPAGE = 14
HUGE = 2 << 20


def madvise_huge(t: torch.Tensor) -> None:
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = (start + HUGE - 1) & ~(HUGE - 1), end & ~(HUGE - 1)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_HUGEPAGE) != 0:
        raise OSError(ctypes.get_errno(), "madvise")


def main() -> None:
    torch.set_num_threads(2)
    ops = cpu_native.load()
    batch, length, heads, kv_heads, dim, block = 16, int(os.environ.get("L", 270)), 9, 3, 64, 16
    blocks_per_seq = -(-length // block)
    num_blocks = batch * blocks_per_seq * 30  # a pool as big as 30 layers' worth
    mode = sys.argv[1] if len(sys.argv) > 1 else "small"
    k = torch.empty(num_blocks, block, kv_heads, dim, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    if mode == "huge":
        madvise_huge(k)
        madvise_huge(v)
    k.copy_(torch.randn(k.shape))
    v.copy_(torch.randn(v.shape))
    tables = torch.randperm(num_blocks)[: batch * blocks_per_seq].view(batch, blocks_per_seq).int().contiguous()
    lens = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(batch, heads, dim).bfloat16()
    out = torch.empty_like(q)
    seqs = rows = torch.arange(batch)
    flush = torch.randn(64 << 20)
    for cache in ("hot", "cold"):
        times = []
        for _ in range(30):
            if cache == "cold":
                flush.add_(1)
            start = time.perf_counter()
            ops.decode_attention(q, k, v, tables, lens, seqs, rows, out, dim ** -0.5)
            times.append(time.perf_counter() - start)
        print(mode, cache, f"{1e3 * statistics.median(times):.3f} ms")


if __name__ == "__main__":
    main()
