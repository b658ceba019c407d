"""Kernel micro-benchmarks on a CUDA GPU: how close paged decode attention gets to the memory bandwidth.

Decode attention is bandwidth-bound: each step reads every request's whole KV cache once. So the
figure of merit is KV bytes read per second, against a device-to-device copy measured in the same
run (bytes read + written, the most a kernel can move). Also store_kv (the per-step K/V write)
and the KV-transfer token gather/scatter, each against its torch counterpart.

Times are medians over repetitions, measured with CUDA events around a CUDA graph of `--inner`
calls (GPU time without Python launch overhead); `eager_us` is the same without the graph, i.e.
what one call costs the host. Writes JSON with --json.

    python benchmarks/attention_bandwidth.py --json gpu_out/kernels.json
    python benchmarks/attention_bandwidth.py --smoke        # CPU: a tiny Triton-interpreter vs torch check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from pdserve.bench.json_out import write_json

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16  # Llama-3.2-1B's attention
BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [512, 1024, 2048, 4096, 8192]


def time_us(fn, *, reps: int, inner: int, graph: bool) -> float:
    """Median microseconds per call of fn over `reps` timings of `inner` calls each."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm the allocator on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        run = g.replay
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph:
            run()
        else:
            for _ in range(inner):
                run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / inner)
    return statistics.median(samples)


def copy_gbps(reps: int) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), reps=reps, inner=5, graph=False)
    return 2 * src.numel() / us / 1e3


def decode_batch(num_seqs: int, context: int, k_cache: torch.Tensor, gen: torch.Generator) -> dict:
    """Metadata for num_seqs decode requests of `context` tokens over random (fragmented) blocks."""
    blocks_per_seq = context // BLOCK_SIZE
    blocks = torch.randperm(k_cache.shape[0], generator=gen)[: num_seqs * blocks_per_seq]
    return {
        "q": torch.randn(num_seqs, NUM_HEADS, HEAD_DIM, dtype=k_cache.dtype, device="cuda"),
        "query_start_loc": torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda"),
        "seq_lens": torch.full((num_seqs,), context, dtype=torch.int32, device="cuda"),
        "block_tables": blocks.view(num_seqs, blocks_per_seq).to(torch.int32).cuda(),
    }


def bench_decode(args, dtype: torch.dtype, copy_rate: float) -> list[dict]:
    from pdserve.kernels import paged_attention, triton_attention

    max_tokens = max(args.batches) * max(args.contexts)
    cache_shape = (max_tokens // BLOCK_SIZE, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(cache_shape, dtype=dtype, device="cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for num_seqs in args.batches:
        for context in args.contexts:
            meta = decode_batch(num_seqs, context, k_cache, gen)
            out = torch.empty_like(meta["q"])

            def step(meta=meta, out=out, context=context):
                paged_attention(meta["q"], k_cache, v_cache, meta["query_start_loc"], meta["seq_lens"],
                                meta["block_tables"], HEAD_DIM**-0.5, max_query_len=1, max_seq_len=context,
                                out=out, backend="triton")

            us = time_us(step, reps=args.reps, inner=args.inner, graph=True)
            eager = time_us(step, reps=args.reps, inner=args.inner, graph=False)
            kv_bytes = 2 * num_seqs * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
            splits, _ = triton_attention.plan_splits(num_seqs, NUM_KV_HEADS, context, 64, k_cache.device)
            gbps = kv_bytes / us / 1e3
            rows.append({"batch": num_seqs, "context": context, "us": round(us, 2), "eager_us": round(eager, 2),
                         "kv_bytes": kv_bytes, "kv_gbps": round(gbps, 1),
                         "fraction_of_copy": round(gbps / copy_rate, 3), "num_splits": splits})
            print(f"decode B={num_seqs:4d} L={context:5d}: {us:9.1f} us  {gbps:7.1f} GB/s "
                  f"({gbps / copy_rate:.0%} of copy)  splits={splits}  eager {eager:.1f} us", flush=True)
    return rows


def check_decode(dtype: torch.dtype) -> dict:
    """Triton against the torch reference on one mid-size batch (and a long split one)."""
    from pdserve.kernels import paged_attention

    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(4096, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    errors = {}
    for num_seqs, context in ((8, 512), (2, 8192)):
        meta = decode_batch(num_seqs, context, k_cache, gen)
        args = (meta["q"], k_cache, v_cache, meta["query_start_loc"], meta["seq_lens"], meta["block_tables"],
                HEAD_DIM**-0.5)
        got = paged_attention(*args, max_query_len=1, max_seq_len=context, backend="triton")
        want = paged_attention(*args, backend="torch")
        errors[f"B{num_seqs}_L{context}"] = (got.float() - want.float()).abs().max().item()
    return {"max_abs_err_vs_torch": errors, "ok": all(e < 2e-2 for e in errors.values())}


def bench_store_kv(args, dtype: torch.dtype) -> dict:
    from pdserve.kernels import store_kv

    num_tokens, num_blocks = 8192, 4096
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    value = torch.randn_like(key)
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:num_tokens].to(torch.int32)
    moved = 4 * key.numel() * key.element_size()  # read key and value, write both caches
    result = {"num_tokens": num_tokens, "bytes_moved": moved}
    # The torch backend reads the slots to the host (a sync), so only Triton is timed in a graph.
    for name, backend, graph in (("triton", "triton", True), ("triton_eager", "triton", False),
                                 ("torch_eager", "torch", False)):
        us = time_us(lambda b=backend: store_kv(key, value, k_cache, v_cache, slots, backend=b),
                     reps=args.reps, inner=args.inner, graph=graph)
        result[name] = {"us": round(us, 2), "gbps": round(moved / us / 1e3, 1)}
    return result


def bench_gather(args, dtype: torch.dtype) -> dict:
    """One request of 4096 tokens out of a 16-layer pool (the KV transfer's send side), and back."""
    from pdserve.kernels.triton_cache import gather_tokens_triton, scatter_tokens_triton
    from pdserve.kvtransfer.payload import gather_tokens, scatter_tokens

    num_layers, num_blocks, num_tokens = 16, 2048, 4096
    pool = torch.randn(num_layers, 2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
    block_ids = torch.randperm(num_blocks)[: num_tokens // BLOCK_SIZE].tolist()
    payload = gather_tokens(pool, block_ids, num_tokens)
    assert torch.equal(gather_tokens_triton(pool, block_ids, num_tokens), payload)
    moved = 2 * payload.numel() * payload.element_size()
    result = {"num_tokens": num_tokens, "num_layers": num_layers, "bytes_moved": moved}
    cases = {"gather_triton": lambda: gather_tokens_triton(pool, block_ids, num_tokens),
             "gather_torch": lambda: gather_tokens(pool, block_ids, num_tokens),
             "scatter_triton": lambda: scatter_tokens_triton(pool, block_ids, payload),
             "scatter_torch": lambda: scatter_tokens(pool, block_ids, payload)}
    for name, fn in cases.items():
        us = time_us(fn, reps=args.reps, inner=max(1, args.inner // 2), graph=False)  # host block lists
        result[name] = {"us": round(us, 2), "gbps": round(moved / us / 1e3, 1)}
    return result


def smoke() -> dict:
    """CPU only: a tiny decode and prefill batch through the Triton interpreter against torch."""
    os.environ["TRITON_INTERPRET"] = "1"
    from pdserve.kernels import paged_attention

    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    v_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    tables = torch.tensor([[3, 1, 6], [0, 5, -1]], dtype=torch.int32)
    errors = {}
    for name, q_lens, seq_lens in (("decode", [1, 1], [40, 20]), ("prefill", [7, 20], [40, 20])):
        starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
        args = (torch.randn(sum(q_lens), 4, 16, generator=gen), k_cache, v_cache, starts,
                torch.tensor(seq_lens, dtype=torch.int32), tables, 0.25)
        got = paged_attention(*args, backend="triton")
        errors[name] = (got - paged_attention(*args, backend="torch")).abs().max().item()
    return {"mode": "smoke", "max_abs_err_vs_torch": errors, "ok": all(e < 1e-4 for e in errors.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU interpreter check instead")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=10)
    args = parser.parse_args()
    if args.smoke:
        result = smoke()
    elif not torch.cuda.is_available():
        print("benchmarks/attention_bandwidth.py measures GPU bandwidth and needs a CUDA GPU; none is visible here. "
              "Run it with --smoke for a tiny CPU (Triton interpreter) correctness check.", file=sys.stderr)
        return 2
    else:
        dtype = getattr(torch, args.dtype)
        rate = copy_gbps(args.reps)
        print(f"device-to-device copy: {rate:.1f} GB/s (read + write)", flush=True)
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "triton": __import__("triton").__version__, "dtype": args.dtype,
                  "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
                            "block_size": BLOCK_SIZE},
                  "copy_gbps": round(rate, 1), "check": check_decode(dtype)}
        print(f"check: {result['check']}", flush=True)
        result["decode"] = bench_decode(args, dtype, rate)
        result["store_kv"] = bench_store_kv(args, dtype)
        print(f"store_kv: {result['store_kv']}", flush=True)
        result["gather"] = bench_gather(args, dtype)
        print(f"gather/scatter: {result['gather']}", flush=True)
    if args.json:
        write_json(args.json, result)
    print(json.dumps(result) if args.smoke else f"wrote {args.json}" if args.json else "done")
    return 0 if result.get("ok", result.get("check", {}).get("ok", True)) else 1


if __name__ == "__main__":
    sys.exit(main())
