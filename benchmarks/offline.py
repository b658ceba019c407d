"""Offline throughput: pdserve's engine against transformers' static batching, same run.

N requests with random token-id prompts and random output lengths (ignore_eos, so every request
generates exactly its length). transformers runs batches of `--hf-batch-size` with left padding;
each batch generates until its longest request is done, and only each request's own output
tokens are credited. Both sides use the same model, dtype, prompts and thread count.

    python benchmarks/offline.py --model smollm2 --dtype bfloat16 --num-requests 64

On CUDA the engine runs decode through CUDA graphs unless --enforce-eager; --vs-eager runs it
both ways on the same workload and records the graphs' speedup (use a decode-heavy workload:
short prompts, long outputs).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

import torch

from pdserve.bench.json_out import write_json


def make_workload(num_requests: int, input_range, output_range, vocab_size: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(rng.randint(*input_range))] for _ in range(num_requests)]
    output_lens = [rng.randint(*output_range) for _ in range(num_requests)]
    return prompts, output_lens


def run_engine(model_path: str, dtype: str, prompts, output_lens, args, enforce_eager: bool) -> dict:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_path, dtype=dtype, device=args.device, num_threads=args.num_threads, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_cache_memory_gb,
              enable_prefix_caching=False, enforce_eager=enforce_eager)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outs)
    assert generated == sum(output_lens), "ignore_eos: every request must produce exactly its length"
    graphs = llm.engine.runner.decode_graphs
    result = {"output_tokens": generated, "seconds": elapsed, "output_tok_per_s": generated / elapsed,
              "cuda_graph_replays": graphs.num_replays if graphs is not None else 0}
    del llm, graphs
    _free(args.device)  # the pool took most of the GPU: give it back before the next run loads
    return result


def run_transformers(model_path: str, dtype: str, prompts, output_lens, args) -> dict:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype).to(args.device).eval()
    pad = model.generation_config.pad_token_id
    pad = pad if pad is not None else 0
    batches = [range(i, min(i + args.hf_batch_size, len(prompts))) for i in range(0, len(prompts), args.hf_batch_size)]
    _hf_batch(model, [prompts[0][:16]], 4, pad)  # warm-up
    start = time.perf_counter()
    for batch in batches:
        _hf_batch(model, [prompts[i] for i in batch], max(output_lens[i] for i in batch), pad)
    _sync(args.device)
    elapsed = time.perf_counter() - start
    credited = sum(output_lens)  # each request's own tokens, not the padding steps
    return {"output_tokens": credited, "seconds": elapsed, "output_tok_per_s": credited / elapsed}


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _hf_batch(model, batch_prompts, max_new_tokens: int, pad: int) -> None:
    width = max(len(p) for p in batch_prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch_prompts], device=model.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts], device=model.device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, pad_token_id=pad)  # min = max: EOS ignored


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], help="one run per dtype")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[64, 128], metavar=("MIN", "MAX"))
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="engine only (no ratio)")
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: decode without CUDA graphs")
    p.add_argument("--vs-eager", action="store_true", help="CUDA: also run with --enforce-eager; record the speedup")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig

    model_path = str(resolve_model(args.model))
    vocab = ModelConfig.from_pretrained(model_path).vocab_size
    prompts, output_lens = make_workload(args.num_requests, args.input_len, args.output_len, vocab, args.seed)
    results = {"model": args.model, "num_requests": args.num_requests, "input_len": args.input_len,
               "output_len": args.output_len, "threads": torch.get_num_threads(),
               "enforce_eager": args.enforce_eager, "runs": {}}
    for dtype in args.dtype:
        run = {"pdserve": run_engine(model_path, dtype, prompts, output_lens, args, args.enforce_eager)}
        if args.vs_eager:
            run["pdserve_eager"] = run_engine(model_path, dtype, prompts, output_lens, args, enforce_eager=True)
            run["graph_speedup"] = run["pdserve"]["output_tok_per_s"] / run["pdserve_eager"]["output_tok_per_s"]
        if not args.skip_hf:
            run["transformers"] = run_transformers(model_path, dtype, prompts, output_lens, args)
            run["ratio"] = run["pdserve"]["output_tok_per_s"] / run["transformers"]["output_tok_per_s"]
        results["runs"][dtype] = run
        line = f"{dtype:>9}: pdserve {run['pdserve']['output_tok_per_s']:8.1f} out tok/s"
        if "graph_speedup" in run:
            line += f" | enforce_eager {run['pdserve_eager']['output_tok_per_s']:8.1f}" \
                    f" | graphs {run['graph_speedup']:.2f}x"
        if "ratio" in run:
            line += f" | transformers (batch {args.hf_batch_size}) {run['transformers']['output_tok_per_s']:8.1f}" \
                    f" | ratio {run['ratio']:.2f}x"
        print(line, flush=True)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
