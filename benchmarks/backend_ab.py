"""One engine step at a base checkout against the working tree's, each in its own process (the Python
around the kernels differs between them), in pairs that alternate which side runs first: a decode
step of --batch requests and a prefill step of --tokens tokens. Each process reports the median wall
and CPU (process) time of its steps; a pair reports tree / base of each. CPU time counts the work
the step did on this process's threads, so it is the steadier figure where other processes share
the cores (then also try --num-threads 1, which has no thread pool to wait on).

    git worktree add /tmp/base ccae120
    python benchmarks/make_random_model.py --shape smollm2 --out /tmp/smollm2   (from outside benchmarks/)
    python -m benchmarks.backend_ab --base /tmp/base --model /tmp/smollm2 --pairs 3

Both sides run with this Python environment; the base builds its compiled ops from its own sources.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One side's process: `pdserve` imports from the tree first on sys.path.
CHILD = r"""
import json, statistics, sys, time
import torch
from pdserve.engine import LLM, SamplingParams
model, dtype, threads, batch, ctx, tokens, steps = sys.argv[1:8]
batch, ctx, tokens, steps, threads = int(batch), int(ctx), int(tokens), int(steps), int(threads)
max_len = max(ctx + steps + 48, tokens + 2)
llm = LLM(model, dtype=dtype, num_threads=threads, block_size=16, skip_tokenizer_init=True, max_num_seqs=batch,
          num_kv_blocks=batch * (max_len // 16 + 2) + tokens // 16 + 8, max_num_batched_tokens=max(tokens, batch * ctx),
          max_model_len=max_len)
engine = llm.engine

def timed(step, n, skip):
    wall, cpu = [], []
    for i in range(n + skip):
        w, c = time.perf_counter(), time.process_time()
        step()
        if i >= skip:
            wall.append(1e3 * (time.perf_counter() - w)), cpu.append(1e3 * (time.process_time() - c))
    return statistics.median(wall), statistics.median(cpu)

out = {}
try:
    g = torch.Generator().manual_seed(0)
    def prefill():
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.add_request(torch.randint(engine.model_config.vocab_size, (tokens,), generator=g).tolist(), params)
        engine.step()
        assert not engine.has_unfinished(), "the prompt is prefilled in one step"
    out["prefill_wall_ms"], out["prefill_cpu_ms"] = timed(prefill, max(3, steps // 4), 1)
    params = SamplingParams(max_tokens=steps + 40, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(engine.model_config.vocab_size, (ctx,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    out["decode_wall_ms"], out["decode_cpu_ms"] = timed(engine.step, steps, 2)
    assert len(engine.scheduler.running) == batch, "every request decodes in the timed steps"
finally:
    llm.close()
print("RESULT " + json.dumps(out))
"""
KEYS = ("decode_wall_ms", "decode_cpu_ms", "prefill_wall_ms", "prefill_cpu_ms")


def run_side(root: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-c", CHILD, args.model, args.dtype, str(args.num_threads), str(args.batch),
           str(args.context_len), str(args.tokens), str(args.steps)]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{root}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="a checkout of the base commit")
    p.add_argument("--tree", default=str(ROOT), help="the checkout to compare (default: this one)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="decode batch")
    p.add_argument("--context-len", type=int, default=256, help="each decode request's context")
    p.add_argument("--tokens", type=int, default=512, help="prefill tokens")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per process (a quarter as many prefills)")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    sides = {"base": Path(args.base).resolve(), "tree": Path(args.tree).resolve()}
    pairs = []
    for i in range(args.pairs):
        order = ("base", "tree") if i % 2 == 0 else ("tree", "base")
        got = {name: run_side(sides[name], args) for name in order}
        pair = {"first": order[0], **{f"{name}_{k}": got[name][k] for name in sides for k in KEYS},
                **{f"ratio_{k}": got["tree"][k] / got["base"][k] for k in KEYS}}
        pairs.append(pair)
        print(f"pair {i + 1} ({order[0]} first): " + ", ".join(
            f"{k} {pair['base_' + k]:.1f} -> {pair['tree_' + k]:.1f} ({pair['ratio_' + k]:.3f})" for k in KEYS), flush=True)
    summary = {k: statistics.median(pr[f"ratio_{k}"] for pr in pairs) for k in KEYS}
    print(f"{args.dtype}, {args.num_threads} threads, decode batch {args.batch} (context {args.context_len}), prefill "
          f"{args.tokens} tokens: tree / base, median of {args.pairs} pairs: "
          + ", ".join(f"{k} {v:.3f}" for k, v in summary.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "pairs": pairs, "median_ratio": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
