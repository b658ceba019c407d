"""The engine's decode step with the oneDNN weight copies (engine/ops/linear.py, kernels/cpu_gemm.py) for no layer,
the wide layers only (out >= 2 x in and >= 1M weights: the rule before every layer was packed) or
every layer (`all`: a copy for each weight of any size), in one process: the same engine and
requests, the variants taking turns step by step (order rotating), medians. The engine as shipped
packs every layer of at least PACK_MIN_WEIGHTS weights: `all` on real models. It measures what the
copies buy.

    python -m benchmarks.onednn_ab --dtype bfloat16 --batch 16 --num-threads 2 --steps 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.decoding import start_decodes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    args = p.parse_args(argv)

    from pdserve.engine import LLM, SamplingParams
    from pdserve.kernels.cpu_gemm import PACK_BATCH_HINT

    max_len = args.context_len + 3 * args.steps + 40
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.batch,
              skip_tokenizer_init=True, max_model_len=max_len, num_kv_blocks=args.batch * (max_len // 16 + 2))
    engine = llm.engine
    layers = [m for m in engine.runner.model.modules() if hasattr(m, "packed")]
    fp32 = []  # every layer's fp32 weight, which F.linear reads in the variants without a copy
    for layer in layers:
        if hasattr(layer, "weight16"):  # bf16 via fp32 (models/cpu_bf16.py); a packed one keeps none
            if layer.weight32 is None:
                layer.weight32 = layer.weight16.float()
            fp32.append(layer.weight32)
        else:
            fp32.append(layer.weight)

    def pack(w: torch.Tensor, wide_only: bool):
        out_features, in_features = w.shape
        if w.dtype != torch.float32 or (wide_only and (out_features < 2 * in_features or w.numel() < 1 << 20)):
            return None
        return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), PACK_BATCH_HINT)

    variants = {
        "none": [None] * len(layers),
        "wide": [pack(w, True) for w in fp32],
        "all": [pack(w, False) for w in fp32],
    }
    print({k: sum(x is not None for x in v) for k, v in variants.items()}, "of", len(layers), "layers hold a copy")
    start_decodes(engine, args.batch, args.context_len,
                  SamplingParams(max_tokens=3 * args.steps + 20, temperature=0, ignore_eos=True))
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for step in range(args.steps + 1):  # the first round warms every variant up
        for name in names[step % 3:] + names[:step % 3]:
            for layer, packed in zip(layers, variants[name]):
                layer.packed = packed
            start = time.perf_counter()
            engine.step()
            if step:
                times[name].append(time.perf_counter() - start)
    llm.close()
    base = statistics.median(times["none"])
    for name in names:
        med = statistics.median(times[name])
        print(f"{args.dtype} batch {args.batch}, {args.num_threads} threads, copies for {name:>4}: "
              f"median {1e3 * med:.1f} ms (min {1e3 * min(times[name]):.1f}), {med / base:.3f}x of none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
