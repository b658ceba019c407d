"""The engine's decode step with the compiled CPU ops (kernels/cpu_*.cpp: the decode attention
kernel and the fused residual add + RMSNorm, RoPE + K/V store and SiLU x up) against the torch code
they replace (gather + SDPA, the torch elementwise ops), in one process: the same engine and
requests, the two taking turns step by step (PDSERVE_CPU_NATIVE switched between steps), medians
per batch size. "kernel" is the compiled ops, "torch" the torch code.

    python -m benchmarks.decode_kernel_ab --dtype bfloat16 --batch-sizes 1,16 --num-threads 2 --steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.decoding import start_decodes
from pdserve.kernels import cpu_native


def measure(args: argparse.Namespace, batch: int) -> dict:
    """Median ms of a decode step with the kernel on and off, `args.steps` of each, alternating."""
    from pdserve.engine import LLM, SamplingParams

    max_len = args.context_len + 2 * args.steps + 40
    saved = os.environ.get(cpu_native.NATIVE_ENV)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=batch,
              skip_tokenizer_init=True, max_model_len=max_len, num_kv_blocks=batch * (max_len // 16 + 2))
    try:
        engine = llm.engine
        start_decodes(engine, batch, args.context_len,
                      SamplingParams(max_tokens=2 * args.steps + 8, temperature=0, ignore_eos=True), seed=batch)
        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        for i in range(2 * args.steps + 2):
            variant = ("kernel", "torch")[i % 2]
            os.environ[cpu_native.NATIVE_ENV] = "1" if variant == "kernel" else "0"
            start = time.perf_counter()
            engine.step()
            if i >= 2:  # one warm-up step each
                times[variant].append(1e3 * (time.perf_counter() - start))
        assert len(engine.scheduler.running) == batch, "every request decodes in the timed steps"
    finally:
        if saved is None:
            os.environ.pop(cpu_native.NATIVE_ENV, None)
        else:
            os.environ[cpu_native.NATIVE_ENV] = saved
        llm.close()
    kernel, plain = statistics.median(times["kernel"]), statistics.median(times["torch"])
    return {"batch": batch, "kernel_ms": kernel, "torch_ms": plain, "ratio": kernel / plain}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if cpu_native.load() is None:
        print("the CPU decode kernel is not available here (see the log): nothing to compare", file=sys.stderr)
        return 1
    rows = [measure(args, int(b)) for b in args.batch_sizes.split(",")]
    print(f"{args.dtype}, context {args.context_len}, {args.num_threads} threads: median ms per decode step")
    print(f"{'batch':>6} {'kernel':>9} {'torch':>9} {'ratio':>7}")
    for r in rows:
        print(f"{r['batch']:>6} {r['kernel_ms']:>9.2f} {r['torch_ms']:>9.2f} {r['ratio']:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
