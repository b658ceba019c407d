"""Paired A/B of engine steps between source trees: a batch-B decode step and a P-token prefill
step of one model. Each tree runs in its own process (importing `pdserve` and
`benchmarks.decoding` from that tree), all of them loaded at once, and the steps take turns one by
one, so a change in the machine's load hits every tree alike.

    python benchmarks/step_ab.py --trees /tmp/base-sched . --model /tmp/smollm2 --rounds 3

A round starts fresh processes: each loads the model and starts B decoding requests of
`--context-len` random tokens; then `--steps` decode steps are timed in turn (order alternating
step by step), the requests aborted, and `--prefills` steps that each prefill one fresh
`--prefill-len`-token prompt (the same prompts in every tree, none a prefix-cache hit) timed in
turn. A round reports each tree's medians; the result is the median over rounds, each tree's
ratio to the first, and the median of the rounds' own ratios (what to quote on a busy machine).
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


def serve(args: argparse.Namespace) -> None:
    """One tree's engine, stepped on command: 'd' times a decode step, 'a' aborts the decoding
    requests, 'p' times the prefill of the next fresh prompt, 'q' quits. Prints ms per step."""
    import torch

    from benchmarks.decoding import start_decodes
    from pdserve.engine import LLM, SamplingParams

    max_len = max(args.context_len + args.steps + 16, args.prefill_len + 8)
    num_blocks = (args.batch + 2) * (max_len // 16 + 2)
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.batch + 1,
              skip_tokenizer_init=True, max_model_len=max_len, num_kv_blocks=num_blocks,
              max_num_batched_tokens=max(2048, args.prefill_len))
    engine = llm.engine
    start_decodes(engine, args.batch, args.context_len,
                  SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True))
    g = torch.Generator().manual_seed(1)
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "q":
            break
        if cmd == "a":
            for request_id in list(engine.scheduler.requests):
                engine.abort(request_id)
            print("ok", flush=True)
            continue
        if cmd == "p":
            prompt = torch.randint(engine.model_config.vocab_size, (args.prefill_len,), generator=g).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        start = time.perf_counter()
        engine.step()
        print(1e3 * (time.perf_counter() - start), flush=True)
        while cmd == "p" and engine.scheduler.has_unfinished():
            engine.step()
    llm.close()


def one_round(trees: list[str], rest: list[str], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    procs = {}
    for tree in trees:
        root = str(Path(tree).resolve())
        procs[tree] = subprocess.Popen([sys.executable, __file__, "--serve", *rest], cwd=root,
                                       env=dict(os.environ, PYTHONPATH=root), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)

    def ask(tree: str, cmd: str) -> str:
        proc = procs[tree]
        proc.stdin.write(cmd + "\n")
        proc.stdin.flush()
        answer = proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"{tree}: exited {proc.wait()}")
        return answer

    try:
        for tree in trees:
            while (line := procs[tree].stdout.readline()).strip() != "ready":  # past anything printed on load
                if not line:
                    raise RuntimeError(f"{tree}: exited {procs[tree].wait()}")
        times = {tree: {"decode_ms": [], "prefill_ms": []} for tree in trees}
        for kind, cmd, count in (("decode_ms", "d", args.steps + 2), ("prefill_ms", "p", args.prefills + 1)):
            for i in range(count):
                for tree in trees if i % 2 == 0 else trees[::-1]:
                    ms = float(ask(tree, cmd))
                    if i >= (2 if cmd == "d" else 1):  # the first steps warm up
                        times[tree][kind].append(ms)
            if cmd == "d":
                for tree in trees:
                    ask(tree, "a")
        for tree in trees:
            procs[tree].stdin.write("q\n")
            procs[tree].stdin.flush()
            procs[tree].wait()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return {tree: {k: statistics.median(v) for k, v in t.items()} for tree, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="source trees (the first is the reference)")
    p.add_argument("--model", required=True, help="a HF folder (benchmarks/make_random_model.py)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per tree and round")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--prefills", type=int, default=5, help="timed prefill steps per tree and round")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # a tree's own process
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.serve:  # run by path: this folder goes first on sys.path; keep only the tree under test
        here = Path(__file__).resolve().parent
        sys.path[:] = [e for e in sys.path if not e or Path(e).resolve() != here]
        serve(args)
        return 0
    passed = list(argv if argv is not None else sys.argv[1:])
    cut = passed.index("--trees")
    end = next((i for i in range(cut + 1, len(passed)) if passed[i].startswith("--")), len(passed))
    rest = passed[:cut] + passed[end:]
    if "--json" in rest:
        at = rest.index("--json")
        del rest[at : at + 2]
    runs: dict[str, list[dict]] = {t: [] for t in args.trees}
    for r in range(args.rounds):
        result = one_round(args.trees, rest, args)
        for tree in args.trees:
            runs[tree].append(result[tree])
            print(f"round {r + 1} {tree}: decode {result[tree]['decode_ms']:.2f} ms, "
                  f"prefill {result[tree]['prefill_ms']:.1f} ms", flush=True)
    ref = args.trees[0]
    report = {}
    for tree in args.trees:
        med = {k: statistics.median(run[k] for run in runs[tree]) for k in ("decode_ms", "prefill_ms")}
        ratio = {k: med[k] / statistics.median(run[k] for run in runs[ref]) for k in med}
        # The same round's ratio: both trees ran through the same minutes of the machine's load.
        paired = {k: statistics.median(a[k] / b[k] for a, b in zip(runs[tree], runs[ref])) for k in med}
        report[tree] = {"runs": runs[tree], "median": med, "ratio_to_first": ratio, "median_round_ratio": paired}
        print(f"{tree}: decode {med['decode_ms']:.2f} ms ({ratio['decode_ms']:.3f}x; rounds' ratios, median "
              f"{paired['decode_ms']:.3f}), prefill {med['prefill_ms']:.1f} ms ({ratio['prefill_ms']:.3f}x; "
              f"{paired['prefill_ms']:.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
