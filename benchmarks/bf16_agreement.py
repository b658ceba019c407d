"""Top-1 agreement of the engine's greedy outputs with transformers, under teacher forcing (the bar:
">= 99% of positions in bf16 on the default model").

    python -m benchmarks.bf16_agreement --model smollm2 --dtype bfloat16 --num-prompts 32 --max-tokens 64 \
        --num-threads 2 --out /tmp/bf16_agreement.json

The engine generates greedily (temperature 0, ignore_eos, --max-tokens each) for --num-prompts
prompts, all in one batch (--max-num-seqs 1: one at a time, the single-stream path). transformers then loads the same folder in the same dtype and runs ONE
forward per request over prompt + the engine's tokens: the logits before each generated position
give its argmax there. Teacher forcing on the engine's sequence keeps one early difference from
turning every later position into a mismatch: each position is judged on the same context.

  agreement   positions where transformers' argmax is the engine's token / all generated positions
  exact tie   a disagreement where the engine's token ties transformers' top logit (argmax took
              the lower id); agreement_or_tie counts these as agreeing
  gap         at a disagreement, transformers' top logit minus its logit of the engine's token;
              a gap within one ulp of the model dtype at the top logit is a near-tie (rounding
              decides it, not the model)

--transformers-baseline also scores transformers' own greedy decode (its KV cache, one request at a
time) against its own teacher-forced forward: the rate at which bf16 disagrees with itself between
an incremental decode and one forward pass, the floor any decoding engine is judged against.

Prompts are 16 short English texts through the model's tokenizer, cycled to --num-prompts;
--random-prompts uses seeded random token ids instead (tiny random models have no real text).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys

import torch

from benchmarks.cpu_floor import cpu_info
from pdserve.bench.json_out import write_json

TARGET = 0.99  # the bar for bf16
PROMPTS = (
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain why the sky is blue in one paragraph.",
    "My favourite recipe for pancakes starts with",
    "List three facts about the planet Mars:",
    "Once upon a time, in a small village by the mountains,",
    "What is the difference between a virus and a bacterium?",
    "The best way to learn a new language is",
    "Translate to French: I would like a cup of coffee, please.",
    "Give me some advice for a job interview.",
    "Photosynthesis is the process by which",
    "Summarize the plot of Romeo and Juliet.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Why do cats purr?",
    "The three most important inventions of the twentieth century were",
    "How do I make my houseplants grow faster?",
)
RANDOM_PROMPT_LEN = (8, 32)  # token ids, inclusive


def make_prompts(model_path, num_prompts: int, random_prompts: bool, seed: int, vocab_size: int) -> list[list[int]]:
    if random_prompts:
        rng = random.Random(seed)
        return [[rng.randrange(10, vocab_size) for _ in range(rng.randint(*RANDOM_PROMPT_LEN))]
                for _ in range(num_prompts)]
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"{model_path} has no usable tokenizer ({e}): pass --random-prompts") from e
    return [list(tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(num_prompts)]


def engine_generate(model_path, prompts: list[list[int]], args) -> list[list[int]]:
    """The engine's greedy tokens for every prompt, --max-num-seqs at a time (default: all)."""
    from pdserve.engine import LLM, SamplingParams

    block_size = 16  # a pool sized to the workload, not the default 2 GB
    blocks = sum(-(-(len(p) + args.max_tokens + 1) // block_size) + 1 for p in prompts)
    llm = LLM(str(model_path), dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.max_num_seqs or len(prompts),
              block_size=block_size, num_kv_blocks=blocks, seed=args.seed, skip_tokenizer_init=True)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        outputs = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.close()
    assert all(len(o) == args.max_tokens for o in outputs), "ignore_eos: every request generates max_tokens"
    return outputs


def transformers_generate(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' own greedy tokens, one request at a time (no padding), decoding with its KV
    cache: the baseline. Scored like the engine, it shows how often bf16 disagrees with itself
    between an incremental decode and one forward over the whole sequence."""
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # ignore_eos, as the engine ran
    try:
        with torch.inference_mode():
            outputs = []
            for prompt in prompts:
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=max_tokens, min_new_tokens=max_tokens)
                outputs.append(out[0, len(prompt):].tolist())
    finally:
        model.generation_config.eos_token_id = eos
    return outputs


def load_transformers(model_path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s values near x (for bf16, 8 bits of mantissa: 2**-7 relative)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(x))) if x else torch.finfo(dtype).tiny


def forced_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """`model`'s logits (fp32) before every position of `output`, teacher-forced on prompt + output:
    the logits at position j predict token j + 1."""
    logits = model(input_ids=torch.tensor([prompt + output])).logits
    return logits[0, len(prompt) - 1:len(prompt) - 1 + len(output)].float()


def forced_argmax(model, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[int]]:
    """`model`'s argmax before every position of `outputs`, teacher-forced on prompt + output."""
    with torch.inference_mode():
        return [forced_logits(model, p, o).argmax(-1).tolist() for p, o in zip(prompts, outputs)]


def same_share(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two runs' tokens are the same."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def fp32_reference(model_path, scored: dict, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """How far bf16 is from the model itself: the float32 forward's argmax on the engine's sequence
    (the same weights, upcast) against the engine's tokens and against transformers' bf16 forward
    (its argmax as `score` took it). The bf16 forward's own agreement with float32 bounds what being
    more exact than it can buy: an engine above that against transformers bf16 must reproduce its
    rounding, not the model."""
    fp32_model = load_transformers(model_path, torch.float32)
    try:
        fp32 = forced_argmax(fp32_model, prompts, outputs)
    finally:
        del fp32_model
    bf16 = [r["transformers_tokens"] for r in scored["requests"]]
    return {"engine_vs_fp32": same_share(outputs, fp32), "transformers_bf16_vs_fp32": same_share(bf16, fp32)}


def score(model, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
    """transformers' argmax at every position of `outputs`, teacher-forced on prompt + output."""
    requests, disagreements = [], []
    with torch.inference_mode():
        for r, (prompt, output) in enumerate(zip(prompts, outputs)):
            logits = forced_logits(model, prompt, output)
            argmax = logits.argmax(-1).tolist()
            first = None
            for i, (want, got) in enumerate(zip(output, argmax)):
                if want == got:
                    continue
                first = i if first is None else first
                top = logits[i, got].item()
                disagreements.append({"request": r, "position": i, "engine_token": want, "transformers_token": got,
                                      "gap": top - logits[i, want].item(), "ulp": ulp(top, model.dtype)})
            agree = sum(w == g for w, g in zip(output, argmax))
            requests.append({"prompt_len": len(prompt), "positions": len(output), "agreements": agree,
                             "agreement": agree / len(output) if output else 1.0, "first_disagreement": first,
                             "transformers_tokens": argmax})
    positions = sum(r["positions"] for r in requests)
    agreements = sum(r["agreements"] for r in requests)
    gaps = [d["gap"] for d in disagreements]
    return {"positions": positions, "agreements": agreements,
            "agreement": agreements / positions if positions else 1.0,
            "num_disagreements": len(disagreements),
            "exact_ties": sum(d["gap"] == 0 for d in disagreements),  # the engine's token ties transformers' max
            "near_ties": sum(d["gap"] <= d["ulp"] for d in disagreements),
            "gap_median": statistics.median(gaps) if gaps else None, "gap_max": max(gaps) if gaps else None,
            "requests_all_agree": sum(r["first_disagreement"] is None for r in requests),
            "requests": requests, "disagreements": disagreements}


def measure(args) -> dict:
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.model_config import ModelConfig
    from pdserve.kvcache.dtypes import parse_dtype

    model_path = resolve_model(args.model)
    dtype = parse_dtype(args.dtype)
    vocab = ModelConfig.from_pretrained(model_path).vocab_size
    prompts = make_prompts(model_path, args.num_prompts, args.random_prompts, args.seed, vocab)
    outputs = engine_generate(model_path, prompts, args)
    gc.collect()  # the engine's pool and weights go before transformers loads its copy
    if args.num_threads:
        torch.set_num_threads(args.num_threads)  # the engine set it too: both sides run alike
    model = load_transformers(model_path, dtype)
    result = {"cpu": cpu_info(), "model": args.model, "dtype": args.dtype, "num_threads": torch.get_num_threads(),
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
              "prompts": "random" if args.random_prompts else "text", "seed": args.seed, "target": TARGET,
              **score(model, prompts, outputs)}
    result["meets_target"] = result["agreement"] >= TARGET
    if args.transformers_baseline:
        base = score(model, prompts, transformers_generate(model, prompts, args.max_tokens))
        result["transformers_baseline"] = {k: v for k, v in base.items() if k not in ("requests", "disagreements")}
    if args.fp32_reference:
        result["fp32_reference"] = fp32_reference(model_path, result, prompts, outputs)
    # an exact tie is the engine's token among transformers' maxima; argmax takes the lowest id
    result["agreement_or_tie"] = (result["agreements"] + result["exact_ties"]) / max(result["positions"], 1)
    return result


def report(result: dict) -> None:
    cpu = result["cpu"]
    print(f"CPU: {cpu['model_name']}  native bf16: {cpu['native_bf16']}  torch {cpu['torch']}")
    print(f"model {result['model']} {result['dtype']}, {result['num_threads']} threads, "
          f"{result['num_prompts']} {result['prompts']} prompts x {result['max_tokens']} tokens")
    print(f"top-1 agreement {100 * result['agreement']:.2f}% ({result['agreements']}/{result['positions']} positions; "
          f"target {100 * result['target']:.0f}%: {'met' if result['meets_target'] else 'NOT met'}); "
          f"{result['requests_all_agree']}/{result['num_prompts']} requests agree everywhere; "
          f"counting exact ties {100 * result['agreement_or_tie']:.2f}%")
    base = result.get("transformers_baseline")
    if base is not None:
        print(f"baseline, transformers' own incremental greedy scored the same way: {100 * base['agreement']:.2f}% "
              f"({base['num_disagreements']} disagreements, {base['near_ties']} within 1 ulp, "
              f"{base['exact_ties']} exact ties)")
    ref = result.get("fp32_reference")
    if ref is not None:
        print(f"against the float32 forward on the same sequences: the engine {100 * ref['engine_vs_fp32']:.2f}%, "
              f"transformers' bf16 forward {100 * ref['transformers_bf16_vs_fp32']:.2f}%")
    if result["num_disagreements"]:
        print(f"{result['num_disagreements']} disagreements: {result['near_ties']} within 1 ulp "
              f"({result['exact_ties']} exact ties), gap median {result['gap_median']:.4g}, max {result['gap_max']:.4g}")
        for d in result["disagreements"][:10]:
            print(f"  request {d['request']} position {d['position']}: engine {d['engine_token']}, "
                  f"transformers {d['transformers_token']}, gap {d['gap']:.4g} (ulp {d['ulp']:.3g})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="'smollm2' or a local HF folder")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads, both sides (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests the engine decodes at once (default: all; 1 runs the single-stream path)")
    p.add_argument("--random-prompts", action="store_true", help="seeded random token ids, not the built-in texts")
    p.add_argument("--transformers-baseline", action="store_true",
                   help="also score transformers' own incremental greedy decode the same way")
    p.add_argument("--fp32-reference", action="store_true",
                   help="also score the engine's tokens and transformers' bf16 forward against the float32 forward")
    p.add_argument("--out", "--json", dest="out", default=None, help="also write the result here (JSON)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    report(result)
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
