"""What tensor parallelism costs on this machine: per-rank weight bytes and decode step time for each
TP size, on a random model of the default model's size (offline engine, float32 by default).

    python benchmarks/tp_overhead.py                       # TP 1 and 2, smollm2-8h, batch 8
    python benchmarks/tp_overhead.py --tp-sizes 1,3 --shape smollm2
    python benchmarks/tp_overhead.py --model /path/to/hf/folder --tp-sizes 1,2

The default model (SmolLM2-135M) has 9 attention heads and 3 KV heads, so it splits over 1, 3 or 9
ranks only; `smollm2-8h` is the same size (hidden 576, 30 layers, intermediate 1536, vocab 49152)
with 8 query heads and 2 KV heads of 72 dims, so TP 2 runs. Threads: `--num-threads` is per rank;
without it each rank gets the CPUs divided among the ranks (the engine's default), so every TP
size uses the same cores. On a CPU the ranks share cores and memory bandwidth: TP cannot be faster
here, the point is the overhead (a gloo all-reduce per row-parallel layer and the step broadcast).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAPES = {
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
    "smollm2-8h": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                       max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5),
}


def make_model(shape: str, out: Path) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2))
    model.save_pretrained(out, safe_serialization=True)
    return out


def measure(model: Path, tp: int, args: argparse.Namespace) -> dict:
    from pdserve.engine import LLM, SamplingParams

    with LLM(str(model), tensor_parallel_size=tp, dtype=args.dtype, num_threads=args.num_threads,
             kv_cache_memory_gb=0.5, skip_tokenizer_init=True) as llm:
        runner = llm.engine.runner
        own = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        ranks = [own, *(runner.executor.worker_param_bytes if runner.executor else [])]
        engine = llm.engine
        params = SamplingParams(max_tokens=args.warmup + args.steps + 2, temperature=0, ignore_eos=True)
        for i in range(args.batch):
            engine.add_request([(7 * i + j) % 1000 + 3 for j in range(args.prompt_len)], params)
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step_requests()  # prefill every prompt
        times = []
        for i in range(args.warmup + args.steps):
            start = time.perf_counter()
            engine.step_requests()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        while engine.has_unfinished():
            engine.step_requests()
    times.sort()
    return {"tp": tp, "param_bytes_per_rank": ranks, "decode_step_ms_p50": 1e3 * statistics.median(times),
            "decode_step_ms_p90": 1e3 * times[int(0.9 * (len(times) - 1))], "batch": args.batch}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a HF folder (default: a random model of --shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-8h")
    p.add_argument("--tp-sizes", default="1,2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=None, help="per rank (default: the CPUs divided among the ranks)")
    p.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-tp-bench-") as tmp:
        model = Path(args.model) if args.model else make_model(args.shape, Path(tmp) / args.shape)
        rows = [measure(model, int(tp), args) for tp in args.tp_sizes.split(",")]
    base = rows[0]
    print(f"{'TP':>3} {'weights/rank MiB':>24} {'vs TP ' + str(base['tp']):>9} {'step p50 ms':>12} "
          f"{'p90 ms':>8} {'vs TP ' + str(base['tp']):>9}")
    for r in rows:
        mib = ", ".join(f"{b / 2**20:.1f}" for b in r["param_bytes_per_rank"])
        print(f"{r['tp']:>3} {mib:>24} {max(r['param_bytes_per_rank']) / base['param_bytes_per_rank'][0]:>9.3f} "
              f"{r['decode_step_ms_p50']:>12.2f} {r['decode_step_ms_p90']:>8.2f} "
              f"{r['decode_step_ms_p50'] / base['decode_step_ms_p50']:>9.2f}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
