"""Paired A/B of an engine step between two source trees: a batch-B decode step and a P-token
prefill step of one model, each tree in its own process, the trees taking turns round by round.

    python benchmarks/step_ab.py --trees /tmp/base-sched . --model /tmp/smollm2 --rounds 3

Each tree's process imports `pdserve` and `benchmarks.decoding` from that tree (PYTHONPATH). Each round runs every tree once (order alternating): the tree's process loads the model, starts B
decoding requests of `--context-len` random tokens, times `--steps` decode steps, then times
`--prefills` steps that each prefill one fresh `--prefill-len`-token prompt (distinct prompts: no
prefix-cache hit). A round reports the medians; the result is the median over rounds per tree, and
each tree's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def measure(args: argparse.Namespace) -> dict:
    """One tree's medians (ms), run inside that tree's process."""
    import torch

    import pdserve
    from benchmarks.decoding import start_decodes
    from pdserve.engine import LLM, SamplingParams

    max_len = max(args.context_len + args.steps + 16, args.prefill_len + 8)
    num_blocks = (args.batch + args.prefills + 1) * (max_len // 16 + 2)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.batch + 1,
              skip_tokenizer_init=True, max_model_len=max_len, num_kv_blocks=num_blocks,
              max_num_batched_tokens=max(2048, args.prefill_len))
    engine = llm.engine
    start_decodes(engine, args.batch, args.context_len,
                  SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True))
    decode = []
    for step in range(args.steps + 2):
        start = time.perf_counter()
        engine.step()
        if step >= 2:
            decode.append(time.perf_counter() - start)
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    g = torch.Generator().manual_seed(1)
    prefill = []
    for i in range(args.prefills + 1):
        prompt = torch.randint(engine.model_config.vocab_size, (args.prefill_len,), generator=g).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        if i:
            prefill.append(time.perf_counter() - start)
        while engine.scheduler.has_unfinished():
            engine.step()
    llm.close()
    return {"pdserve": str(Path(pdserve.__file__).parent), "decode_ms": 1e3 * statistics.median(decode), "prefill_ms": 1e3 * statistics.median(prefill)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="source trees (the first is the reference)")
    p.add_argument("--model", required=True, help="a HF folder (benchmarks/make_random_model.py)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per run")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefills", type=int, default=5, help="timed prefill steps per run")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a tree's own process
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.one:  # run by path: this folder is on sys.path, where benchmarks/kernels.py shadows a package
        here = Path(__file__).resolve().parent
        sys.path[:] = [e for e in sys.path if not e or Path(e).resolve() != here]
        print(json.dumps(measure(args)))
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])
    cut = passed.index("--trees")
    end = next((i for i in range(cut + 1, len(passed)) if passed[i].startswith("--")), len(passed))
    rest = passed[:cut] + passed[end:]
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        order = args.trees if r % 2 == 0 else args.trees[::-1]
        for tree in order:
            root = str(Path(tree).resolve())
            env = dict(os.environ, PYTHONPATH=root)
            out = subprocess.run([sys.executable, __file__, "--one", *rest], cwd=root, env=env,
                                 capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {tree}: {runs[tree][-1]}", flush=True)
    ref = args.trees[0]
    result = {}
    for tree in args.trees:
        med = {k: statistics.median(run[k] for run in runs[tree]) for k in ("decode_ms", "prefill_ms")}
        ratio = {k: med[k] / statistics.median(run[k] for run in runs[ref]) for k in med}
        result[tree] = {"runs": runs[tree], "median": med, "ratio_to_first": ratio}
        print(f"{tree}: decode {med['decode_ms']:.2f} ms ({ratio['decode_ms']:.3f}x), "
              f"prefill {med['prefill_ms']:.1f} ms ({ratio['prefill_ms']:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
