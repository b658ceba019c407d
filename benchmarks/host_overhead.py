"""The engine's own cost per decode step: a model so small that the forward is nearly
free (1 layer, hidden 64, vocab 512, random weights), B requests decoding together, and each
step's time split by the engine's always-on phase timings (engine/step_timings.py):

    schedule | prepare (host tensors + upload) | forward (model + logits) | sample | output | total
    host work = total - forward

    python -m benchmarks.host_overhead --batch-sizes 64,256 --steps 200 --repeats 3 --json out.json

Every step timed is a decode step of the whole batch, as columns (engine/decode_batch.py).

Each repeat adds B fresh requests (short prompts, greedy, ignore_eos, room for every step),
prefills them, runs a few warm-up steps, then times `--steps` offline engine steps
(`LLMEngine.step`); the reported figures are medians over the steps of every repeat.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from pdserve.engine.step_timings import PHASES

SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
_WARMUP_STEPS = 3
_FIELDS = (*PHASES, "total", "host")


def make_model(out: Path) -> Path:
    """Write the random 1-layer model as a Hugging Face folder (float32 safetensors)."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).save_pretrained(out, safe_serialization=True)
    return out


def measure(model: Path, batch: int, args: argparse.Namespace) -> dict:
    """Per-step phase times (ms) of `args.repeats` x `args.steps` decode steps at `batch` requests."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    max_len = args.prompt_len + _WARMUP_STEPS + args.steps + 4
    block_size = 16
    config = EngineConfig(model, dtype="float32", max_num_seqs=batch, block_size=block_size,
                          num_kv_blocks=batch * -(-max_len // block_size) + 1, num_threads=args.num_threads,
                          max_num_batched_tokens=max(2048, batch * args.prompt_len))
    samples = {name: [] for name in _FIELDS}
    with LLMEngine(config) as engine:
        for repeat in range(args.repeats):
            params = SamplingParams(max_tokens=max_len - args.prompt_len - 1, temperature=0, ignore_eos=True)
            for i in range(batch):
                prompt = [(7 * i + 13 * j + repeat) % (SHAPE["vocab_size"] - 3) + 3 for j in range(args.prompt_len)]
                engine.add_request(prompt, params, request_id=f"r{repeat}-{i}")
            sched = engine.scheduler
            while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
                engine.step()  # prefill every prompt
            for _ in range(_WARMUP_STEPS):
                engine.step()
            for _ in range(args.steps):
                engine.step()
                if len(sched.running) != batch:
                    raise RuntimeError(f"the batch shrank to {len(sched.running)}: size the pool larger")
                t = engine.timings
                for name in PHASES:
                    samples[name].append(1e3 * getattr(t, name))
                samples["total"].append(1e3 * t.total)
                samples["host"].append(1e3 * t.host)
            for request_id in list(sched.requests):
                engine.abort(request_id)
    return {"batch": batch, "steps": args.steps, "repeats": args.repeats,
            "median_ms": {name: statistics.median(v) for name, v in samples.items()},
            "mean_ms": {name: statistics.fmean(v) for name, v in samples.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--model", default=None, help="a HF folder (default: the random 1-layer model)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pdserve-host-bench-") as tmp:
        model = Path(args.model) if args.model else make_model(Path(tmp) / "model")
        rows = [measure(model, int(b), args) for b in args.batch_sizes.split(",")]
    print(f"{'batch':>6} " + " ".join(f"{name:>9}" for name in _FIELDS) + "   (median ms per step)")
    for r in rows:
        print(f"{r['batch']:>6} " + " ".join(f"{r['median_ms'][name]:>9.3f}" for name in _FIELDS))
    report = {"shape": SHAPE, "prompt_len": args.prompt_len, "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
