"""A prefix hit served from the disk KV tier against recomputing it, on this CPU, in one engine.

    python benchmarks/kv_tier.py --json /tmp/kv_tier.json   # defaults: a random SmolLM2-135M-shaped model

The engine runs with `--kv-offload disk` and a KV pool of --pool-blocks blocks (default: one
prompt's, so that its blocks are evicted as soon as other prompts run). Each repeat:

  1. --fillers fresh prompts of --prompt-tokens random tokens run (1 output token each): they evict
     prompt A's blocks from the pool, and the pool's evictions go to the disk tier;
  2. A runs (1 output token): its prefix is found in the tier, loaded back (verified) and only the
     last token computed: `tier` = the wall time from add_request to its first token;
  3. --fillers more fresh prompts evict A again, then A's keys are dropped from the tier, and A runs
     again: everything is recomputed (`recompute`), in the same engine, minutes apart at most.

Medians over --repeats (A is computed once before the first). The working set is every distinct
prompt's blocks (A and all the fillers); the pool's share of it is printed (<= 10% by default).
The tier's file sits in the page cache here (written moments before): a hit reads memory, hashes
it (blake2b) and copies it into the pool; a cold device read would add its own time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.json_out import report


def cpu_info() -> dict:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"model_name": model, "avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags,
            "cpus": os.cpu_count()}


def run_one(engine, prompt: list[int]) -> tuple[float, int, int, float]:
    """(seconds to the first token, the token, cached prompt tokens, schedule seconds)."""
    from pdserve.engine import SamplingParams

    start = time.perf_counter()
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    schedule = 0.0
    while True:
        outs = engine.step()
        schedule += engine.timings.schedule
        out = next((o for o in outs if o.request_id == request_id), None)
        if out is not None:
            return time.perf_counter() - start, out.token_ids[0], out.num_cached_tokens, schedule


def keys_of(prompt: list[int], block_size: int) -> list[int]:
    keys, parent = [], 0
    for start in range(0, len(prompt) - block_size, block_size):
        parent = hash((parent, tuple(prompt[start : start + block_size])))
        keys.append(parent)
    return keys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local HF folder (default: a random model of --shape)")
    p.add_argument("--shape", default="smollm2", help="benchmarks/make_random_model.py shape (default: smollm2)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=None, help="default: one prompt's blocks, plus one")
    p.add_argument("--fillers", type=int, default=2, help="fresh prompts run to evict A, per eviction")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--kv-offload-dir", default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-bench-") as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from make_random_model import make

            model = str(Path(tmp) / args.shape)
            make(args.shape, model, "bfloat16")
        n, bs = args.prompt_tokens, args.block_size
        pool = args.pool_blocks or -(-(n + 1) // bs) + 1
        config = EngineConfig(model_path=Path(model), dtype=args.dtype, block_size=bs, num_kv_blocks=pool,
                              max_num_batched_tokens=max(2048, n + 1), num_threads=args.num_threads,
                              kv_offload="disk", kv_offload_gb=1.0, kv_offload_dir=args.kv_offload_dir)
        with LLMEngine(config) as engine:
            engine.warm_up()
            vocab = engine.model_config.vocab_size
            rng = random.Random(0)
            fresh = lambda: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
            prompt_a = fresh()
            bm, tier = engine.block_manager, engine.kv_tier
            num_prompts = 1
            _, first_token, _, _ = run_one(engine, prompt_a)
            tier_s, recompute_s, tier_sched, recompute_sched, cached = [], [], [], [], []
            for _ in range(args.repeats):
                for _ in range(args.fillers):
                    run_one(engine, fresh())
                num_prompts += args.fillers
                hits_before, corrupt_before = tier.hits, tier.corrupt
                t, tok, num_cached, sched = run_one(engine, prompt_a)
                assert tok == first_token, "a tier hit changed the greedy token"
                assert tier.corrupt == corrupt_before and tier.hits > hits_before, "A was not served from the tier"
                tier_s.append(t)
                tier_sched.append(sched)
                cached.append(num_cached)
                for _ in range(args.fillers):
                    run_one(engine, fresh())
                num_prompts += args.fillers
                for key in keys_of(prompt_a, bs):
                    assert key not in bm.cached, "A was not evicted from the pool: raise --fillers"
                    tier.drop(key)
                t, tok, num_cached, sched = run_one(engine, prompt_a)
                assert tok == first_token and num_cached == 0
                recompute_s.append(t)
                recompute_sched.append(sched)
            working_set = num_prompts * -(-(n + 1) // bs)
            result = {
                "model": args.model or f"random {args.shape}", "dtype": str(engine.config.torch_dtype),
                "prompt_tokens": n, "block_size": bs, "pool_blocks": pool, "working_set_blocks": working_set,
                "pool_share_of_working_set": round(pool / working_set, 3),
                "block_bytes": tier.block_bytes, "tokens_from_tier": statistics.median(cached),
                "tier_bytes_per_hit": statistics.median(cached) // bs * tier.block_bytes,
                "repeats": args.repeats, "threads": torch.get_num_threads(),
                "tier_s": statistics.median(tier_s), "recompute_s": statistics.median(recompute_s),
                "tier_schedule_s": statistics.median(tier_sched),  # the loads (read, verify, copy) happen here
                "recompute_schedule_s": statistics.median(recompute_sched),
                "speedup": statistics.median(recompute_s) / statistics.median(tier_s),
                "tier_s_all": tier_s, "recompute_s_all": recompute_s, "tier_schedule_s_all": tier_sched, "tier": tier.stats(), "cpu": cpu_info(),
            }
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
