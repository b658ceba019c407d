"""The compiled decode attention alone: B sequences of CTX tokens with the default model's heads (9
query, 3 KV, head_dim 64), bf16, over 30 layers of caches whose blocks lie in random order. "hot"
runs one layer's cache 30 times (it stays in cache), "cold" reads 30 of them after a 512 MiB read.
Medians of 7 rounds; the GB/s is the K/V read over the time.

    python benchmarks/results/eighth/decode_attention_kv.py 16 256
"""

import statistics
import sys
import time

import torch

from pdserve.kernels import cpu_native

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def main() -> None:
    ops = cpu_native.load()
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    batch, ctx = int(sys.argv[1]), int(sys.argv[2])
    blocks = -(-ctx // BLOCK)
    g = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(batch * blocks, BLOCK, KV_HEADS, DIM, generator=g).bfloat16() for _ in range(2))
              for _ in range(LAYERS)]
    tables = torch.randperm(batch * blocks, generator=g).int().view(batch, blocks).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32)
    seqs = rows = torch.arange(batch)
    q = torch.randn(batch, HEADS, DIM, generator=g).bfloat16()
    out = torch.empty_like(q)
    evict = torch.ones(2**27)
    kv_bytes = LAYERS * batch * ctx * KV_HEADS * DIM * 2 * 2
    for name, layers in (("hot (one layer's cache x30)", [caches[0]] * LAYERS), ("cold (30 layers)", caches)):
        times = []
        for i in range(8):
            if layers is caches:
                evict.sum()
            start = time.perf_counter()
            for k, v in layers:
                ops.decode_attention(q, k, v, tables, lens, seqs, rows, out, DIM**-0.5)
            if i:
                times.append(time.perf_counter() - start)
        ms = 1e3 * statistics.median(times)
        print(f"{name}: {ms:.2f} ms for 30 layers, {kv_bytes / ms / 1e6:.1f} GB/s of K/V")


if __name__ == "__main__":
    main()
