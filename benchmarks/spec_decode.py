"""Speculative decoding, offline: output tok/s and TPOT with ngram speculation against without, in
the same run, on a workload whose outputs copy their prompts ("repeat this text") and on one whose
outputs do not (short stories); acceptance rate per position; greedy outputs checked
token-identical to the run without speculation; optionally a draft model (correctness, speed).

    python -m benchmarks.spec_decode --model smollm2 --dtype float32 --num-requests 16 --max-num-seqs 4 --k 2 4 \\
        --random-draft --json benchmarks/results/spec_decode.json

Every run is greedy and drives the engine step by step: TPOT is, per request, (time of its last
token - time of its first) / (tokens - 1), averaged over requests; tok/s counts output tokens
over the run's wall time (prefill included, as a user sees it). `--random-draft` builds a small
random model with the target's vocabulary as a draft: it is accepted almost never, so it shows
correctness and the cost of a useless draft, not a speedup.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the river morning quiet engine station garden letter window winter market teacher "
         "small bright careful northern paper silver road harbor kitchen lamp orchard bridge "
         "music evening stone village forest doctor painter island summer").split()
TOPICS = ("a lighthouse keeper", "a lost key", "the first snow", "a robot learning to cook", "a long train ride",
          "an old map", "a city at night", "a quiet library")


def passage(rng: random.Random, num_sentences: int) -> str:
    sentences = []
    for _ in range(num_sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 12))]
        sentences.append(" ".join(words).capitalize() + ".")
    return " ".join(sentences)


def workloads(n: int, seed: int) -> dict[str, list[str]]:
    rng = random.Random(seed)
    copy = [f"Repeat the following text exactly, word for word:\n\n{passage(rng, rng.randint(3, 6))}"
            for _ in range(n)]
    story = [f"Write a short story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]
    return {"copy": copy, "no_copy": story}


def encode(tokenizer, prompts: list[str]) -> list[list[int]]:
    if getattr(tokenizer, "chat_template", None):
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True) for p in prompts]
        return [list(x["input_ids"] if isinstance(x, dict) or hasattr(x, "input_ids") else x) for x in ids]
    return [tokenizer.encode(p) for p in prompts]


def run(model_path: str, prompts: list[list[int]], spec: dict | None, args) -> dict:
    """One engine, one pass over `prompts` (greedy); timings per request from the step loop."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(model_path, dtype=args.dtype, device=args.device, num_threads=args.num_threads,
              max_num_seqs=args.max_num_seqs, kv_cache_memory_gb=args.kv_cache_memory_gb,
              enable_prefix_caching=False, speculative_config=spec, skip_tokenizer_init=True)
    engine = llm.engine
    engine.warm_up()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    ids = [engine.add_request(p, params) for p in prompts]
    first, last, tokens = {}, {}, {}
    start = time.perf_counter()
    while engine.has_unfinished():
        stepped = engine.step_requests()
        now = time.perf_counter()
        for r in stepped:
            first.setdefault(r.request_id, now)
            last[r.request_id] = now
            tokens[r.request_id] = list(r.output_token_ids)
    elapsed = time.perf_counter() - start
    num_out = sum(len(tokens[i]) for i in ids)
    tpots = [(last[i] - first[i]) / (len(tokens[i]) - 1) for i in ids if len(tokens[i]) > 1]
    result = {"output_tokens": num_out, "seconds": elapsed, "output_tok_per_s": num_out / elapsed,
              "mean_tpot_ms": 1000 * sum(tpots) / max(1, len(tpots)), "token_ids": [tokens[i] for i in ids]}
    if spec is not None:
        result["spec"] = engine.spec_stats.to_dict()
    proposer = engine.proposer
    if hasattr(proposer, "num_catch_up_tokens"):  # a draft model: what building its KV here cost
        result["draft"] = {"forwards": proposer.num_forwards, "catch_up_tokens": proposer.num_catch_up_tokens,
                           "seconds": proposer.seconds}
    del llm, engine
    return result


def draft_build_cost(model_path: str, draft_path: str, prompt_len: int, args) -> dict:
    """The choice between building a request's draft KV on the decode node and shipping it: time one
    draft prefill of `prompt_len` tokens against the target's prefill of the same tokens, and
    the KV bytes per token each model would put on the wire."""
    from pdserve.engine import LLM
    from pdserve.engine.attention_metadata import BatchChunk

    llm = LLM(model_path, dtype=args.dtype, device=args.device, num_threads=args.num_threads,
              kv_cache_memory_gb=args.kv_cache_memory_gb, skip_tokenizer_init=True,
              speculative_config={"model": draft_path, "num_speculative_tokens": 1})
    engine, draft = llm.engine, llm.engine.proposer
    tokens = [(7 * i) % (engine.model_config.vocab_size - 10) + 10 for i in range(prompt_len)]
    block_ids = list(engine.block_manager.allocate("draft-build", prompt_len))
    chunk = [BatchChunk(tokens, 0, block_ids, 1)]
    timings = {}
    for name, runner in (("target", engine.runner), ("draft", draft.runner)):
        runner.greedy_next(chunk)  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            runner.greedy_next(chunk)
        timings[name] = (time.perf_counter() - start) / 3
    engine.block_manager.free("draft-build")
    elem = {"target": engine.model_config.kv_elements_per_token, "draft": draft.model_config.kv_elements_per_token}
    size = engine.runner.kv_buffer.element_size()
    out = {"prompt_len": prompt_len, "target_prefill_s": timings["target"], "draft_prefill_s": timings["draft"],
           "draft_over_target": timings["draft"] / timings["target"],
           "target_kv_bytes_per_token": elem["target"] * size, "draft_kv_bytes_per_token": elem["draft"] * size}
    print(f"  draft KV build, {prompt_len} tokens: draft {1000 * timings['draft']:.1f} ms vs target prefill "
          f"{1000 * timings['target']:.1f} ms; shipping it would add {out['draft_kv_bytes_per_token']} B/token to the "
          f"target's {out['target_kv_bytes_per_token']} B/token", flush=True)
    del llm, engine, draft
    return out


def random_draft(target_path: str, out: Path) -> str:
    """A small random Llama with the target's vocabulary and context: a draft for correctness only."""
    import torch
    import transformers

    from pdserve.engine.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(target_path)
    config = transformers.LlamaConfig(vocab_size=mc.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=mc.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    return str(out)


def summarize(name: str, base: dict, res: dict) -> dict:
    same = res["token_ids"] == base["token_ids"]
    line = {"output_tok_per_s": res["output_tok_per_s"], "mean_tpot_ms": res["mean_tpot_ms"],
            "speedup_tok_per_s": res["output_tok_per_s"] / base["output_tok_per_s"],
            "tpot_ratio": res["mean_tpot_ms"] / base["mean_tpot_ms"] if base["mean_tpot_ms"] else None,
            "token_identical": same, **({"spec": res["spec"]} if "spec" in res else {})}
    rates = res.get("spec", {}).get("acceptance_rate_per_pos", [])
    print(f"  {name:>18}: {res['output_tok_per_s']:8.1f} tok/s  TPOT {res['mean_tpot_ms']:7.1f} ms  "
          f"x{line['speedup_tok_per_s']:.2f}  identical={same}  accept/pos {[round(r, 2) for r in rates]}",
          flush=True)
    return line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--num-requests", type=int, default=16, help="per workload")
    p.add_argument("--max-num-seqs", type=int, default=4, help="requests decoded at once")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens, one ngram run each")
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--draft-model", default=None, help="also run this draft model (shares the tokenizer)")
    p.add_argument("--random-draft", action="store_true", help="also run a small random draft (correctness)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--draft-build-len", type=int, default=512, help="prompt tokens of the draft KV build measurement")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from pdserve.bench.json_out import write_json
    from pdserve.engine.loader import resolve_model

    model_path = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    results = {"model": args.model, "dtype": args.dtype, "device": args.device, "num_requests": args.num_requests,
               "max_num_seqs": args.max_num_seqs, "max_tokens": args.max_tokens, "workloads": {}}
    scratch = tempfile.TemporaryDirectory()
    drafts = {}
    if args.draft_model:
        drafts["draft"] = args.draft_model
    if args.random_draft:
        drafts["random_draft"] = random_draft(model_path, Path(scratch.name) / "random-draft")
    for name, texts in workloads(args.num_requests, args.seed).items():
        prompts = encode(tokenizer, texts)
        print(f"{name}: {len(prompts)} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens",
              flush=True)
        base = run(model_path, prompts, None, args)
        summarize("no speculation", base, base)
        runs = {"none": {"output_tok_per_s": base["output_tok_per_s"], "mean_tpot_ms": base["mean_tpot_ms"]}}
        for k in args.k:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max}
            runs[f"ngram_k{k}"] = summarize(f"ngram k={k}", base, run(model_path, prompts, spec, args))
        for label, path in drafts.items():
            spec = {"model": path, "num_speculative_tokens": args.k[0]}
            runs[f"{label}_k{args.k[0]}"] = summarize(f"{label} k={args.k[0]}", base,
                                                      run(model_path, prompts, spec, args))
        results["workloads"][name] = {"output_tokens": base["output_tokens"], "runs": runs}
    results["draft_build"] = {label: draft_build_cost(model_path, path, args.draft_build_len, args)
                              for label, path in drafts.items()}
    scratch.cleanup()
    if args.json:
        write_json(args.json, results)
    bad = [(w, r) for w, v in results["workloads"].items() for r, x in v["runs"].items()
           if x.get("token_identical") is False]
    if bad:
        # Exact in exact arithmetic; in bf16 the verification's other batch shapes round differently
        # and can flip a near-tie (as a different batch composition can without speculation).
        print(f"NOT token-identical: {bad}", file=sys.stderr)
        if args.dtype == "float32":
            return 1
    print(json.dumps({w: {r: round(x["output_tok_per_s"], 1) for r, x in v["runs"].items()}
                      for w, v in results["workloads"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
