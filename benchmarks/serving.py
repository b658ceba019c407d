"""Serving throughput: the disaggregated stack (and the colocated mode) over HTTP, against
transformers' static batching on the same prompts, model and dtype, in the same run.

N requests of `--input-len` random prompt tokens and `--output-len` output tokens (ignore_eos)
stream through `/v1/completions` with at most `--concurrency` in flight. transformers runs the same
prompts in batches of `--concurrency` (all prompts have the same length, so no padding waste).

    python -m benchmarks.serving --model smollm2 --dtype bfloat16 --modes disagg colocated hf

Threads: transformers and the colocated node use every core. 1P+1D shares them: the decode node
runs on every core, the prefill node on half (--decode-threads, --prefill-threads; --num-threads
gives both nodes that many).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/serving.py): its helpers import as benchmarks.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.json_out import write_json  # noqa: E402


async def _one(session, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    start = time.perf_counter()
    first, arrivals, num_tokens = None, [], 0  # arrivals: (time, tokens) per chunk
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            ids = json.loads(line[6:])["choices"][0].get("token_ids", []) if '"choices"' in line else []
            if ids:
                now = time.perf_counter()
                first = first or now
                arrivals.append((now, len(ids)))
                num_tokens += len(ids)
    # A chunk of k tokens is k inter-token gaps of a k-th of its delay (as `pdserve bench serve`).
    itl = [(b - a) / k for (a, _), (b, k) in zip(arrivals, arrivals[1:]) for _ in range(k)]
    return {"ttft": first - start, "e2e": time.perf_counter() - start, "num_tokens": num_tokens, "itl": itl}


async def run_load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def limited(p):
            async with sem:
                return await _one(session, url, p, max_tokens)

        await limited(prompts[0][:8])  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        elapsed = time.perf_counter() - start
    tokens = sum(r["num_tokens"] for r in results)
    assert tokens == len(prompts) * max_tokens, "every request must produce exactly max_tokens"
    itl = [x for r in results for x in r["itl"]]
    return {"output_tokens": tokens, "seconds": elapsed, "output_tok_per_s": tokens / elapsed,
            "ttft_p50_s": statistics.median(r["ttft"] for r in results),
            "itl_p50_s": statistics.median(itl) if itl else None}


def run_stack(mode: str, args, prompts) -> dict:
    from benchmarks.compare import stack_flags
    from benchmarks.harness.stack import Stack

    # Every mode gets the machine's cores: one colocated node all of them; 1P+1D by default the decode
    # node all of them and the prefill node half (disagg_threads).
    threads = args.num_threads
    prefill_args = args.prefill_args
    if mode == "disagg":
        threads, prefill_threads = disagg_threads(args)
        prefill_args = f"--num-threads {prefill_threads} {prefill_args}".strip()
    kw, extra = stack_flags(mode, argparse.Namespace(num_threads=threads, device="cpu", serve_args=""), args.dtype)
    stack = Stack(args.model, extra=extra, timeout=900, prefill_args=prefill_args, **kw)
    try:
        return asyncio.run(run_load(stack.url, prompts, args.output_len, args.concurrency))
    finally:
        stack.close()


def disagg_threads(args) -> tuple[int, int]:
    """(decode node's threads, prefill node's threads) for 1P+1D on this one machine. By default the
    decode node runs on every core and the prefill node on half of them: decode steps are the
    steady load, prefills come in bursts, so the cores are shared rather than split (on 2 cores,
    505 against 413 out tok/s for one thread each, TTFT p50 0.46 against 0.24 s: RESULTS.md).
    --num-threads alone gives both that many, as before."""
    cores = os.cpu_count() or 1
    if args.num_threads is not None:
        return args.decode_threads or args.num_threads, args.prefill_threads or args.num_threads
    return args.decode_threads or cores, args.prefill_threads or max(1, cores // 2)


def run_hf(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.offline import _hf_batch
    from pdserve.engine.loader import resolve_model

    torch.set_num_threads(args.num_threads or torch.get_num_threads())
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=dtype).eval()
    _hf_batch(model, [prompts[0][:8]], 4, 0)
    start = time.perf_counter()
    for i in range(0, len(prompts), args.concurrency):
        _hf_batch(model, prompts[i : i + args.concurrency], args.output_len, 0)
    elapsed = time.perf_counter() - start
    tokens = len(prompts) * args.output_len
    return {"output_tokens": tokens, "seconds": elapsed, "output_tok_per_s": tokens / elapsed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--modes", nargs="+", default=["disagg", "colocated", "hf"], choices=["disagg", "colocated", "hf"])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=130)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-threads", type=int, default=None,
                   help="per node, and transformers' (default: every core; for 1P+1D see --decode-threads)")
    p.add_argument("--decode-threads", type=int, default=None, help="1P+1D: the decode node's (default: every core)")
    p.add_argument("--prefill-threads", type=int, default=None,
                   help="1P+1D: the prefill node's (default: half the cores)")
    p.add_argument("--prefill-args", default="", help="extra flags for the prefill node (disagg mode)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(resolve_model(args.model)).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    results = {"args": {k: str(v) for k, v in vars(args).items()}}
    for mode in args.modes:
        results[mode] = run_hf(args, prompts) if mode == "hf" else run_stack(mode, args, prompts)
        print(f"{args.dtype:>9} {mode:>9}: {results[mode]['output_tok_per_s']:8.1f} out tok/s "
              f"({results[mode]['seconds']:.1f} s)", flush=True)
    if "hf" in results:
        for mode in ("disagg", "colocated"):
            if mode in results:
                ratio = results[mode]["output_tok_per_s"] / results["hf"]["output_tok_per_s"]
                results[f"{mode}_over_hf"] = ratio
                print(f"{mode} / transformers static batching: {ratio:.2f}x")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
