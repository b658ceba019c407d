"""Parallel sampling, offline: n choices per prompt in one request (one prefill, shared blocks)
against the same n samples as n separate requests, in the same run and on the same prompts.

    python -m benchmarks.parallel_sampling --model smollm2 --num-prompts 8 --prompt-len 300 \\
        --n 4 --max-tokens 64 --json benchmarks/results/parallel_sampling.json

Both sides sample with temperature 1 and ignore_eos (every sample generates exactly max_tokens);
the separate side seeds request i of a prompt with seed + i, the derived seed of choice i, so
both sides generate the same tokens (`num_samples_differing` counts those that do not: 0 in
float32; in bfloat16 rounding depends on the batch's shape, so a sampled token may flip and the
sample diverge from there). Prefix caching is off on both sides, so the
separate requests do not share the prompt through the cache either. Each side drives the engine
step by step and records wall time, output tok/s, prompt tokens the forwards computed, and the
peak of KV blocks in use.
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def run(llm, prompts, n: int, max_tokens: int, seed: int, together: bool) -> tuple[dict, list]:
    from pdserve.engine import SamplingParams

    engine = llm.engine
    base = dict(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    ids = []
    for k, p in enumerate(prompts):
        if together:
            ids.append([engine.add_request(p, SamplingParams(n=n, seed=seed + 1000 * k, **base))])
        else:
            ids.append([engine.add_request(p, SamplingParams(seed=seed + 1000 * k + i, **base)) for i in range(n)])
    computed_before = engine.scheduler.num_prompt_tokens_computed
    outputs, peak_blocks = {}, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out.token_ids
        peak_blocks = max(peak_blocks, engine.block_manager.num_used_blocks)
    elapsed = time.perf_counter() - start
    samples = [[outputs[f"{g[0]}#{i}"] for i in range(n)] if together else [outputs[r] for r in g] for g in ids]
    num_tokens = sum(len(t) for s in samples for t in s)
    return {"seconds": elapsed, "output_tokens": num_tokens, "output_tok_per_s": num_tokens / elapsed,
            "prompt_tokens_computed": engine.scheduler.num_prompt_tokens_computed - computed_before,
            "peak_kv_blocks_used": peak_blocks}, samples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=300)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from pdserve.bench.json_out import report
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device, num_threads=args.num_threads,
              kv_cache_memory_gb=args.kv_cache_memory_gb, enable_prefix_caching=False,
              max_num_seqs=max(256, args.n * args.num_prompts))
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(10, min(vocab, 30000)) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    together, a = run(llm, prompts, args.n, args.max_tokens, args.seed, together=True)
    separate, b = run(llm, prompts, args.n, args.max_tokens, args.seed, together=False)
    result = {"args": vars(args), "block_size": llm.engine.config.block_size, "n_choices": together,
              "separate_requests": separate,
              "num_samples_differing": sum(x != y for ga, gb in zip(a, b) for x, y in zip(ga, gb)),
              "speedup": separate["seconds"] / together["seconds"],
              "kv_blocks_saved": separate["peak_kv_blocks_used"] - together["peak_kv_blocks_used"]}
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
