"""The engine's decode step with decoder layers calling their oneDNN copies straight
(DecoderLayer.forward_direct) against the module calls, taking turns in one engine: 10 rounds of
4 steps each way, B sequences of 256-token random prompts on the default model; prints each
variant's per-round medians and the ratio per round.

    python benchmarks/results/decode_kernel/direct_gemms_ab.py 16 bfloat16

Recorded in benchmarks/RESULTS.md, issue 13 fifth part."""

import statistics
import sys
import time

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models import llama


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    llm = LLM("smollm2", dtype=dtype, num_threads=2, max_num_seqs=batch, num_kv_blocks=batch * 40, block_size=16,
              skip_tokenizer_init=True, max_model_len=700)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(engine.model_config.vocab_size, (256,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    direct_gemms = llama.DecoderLayer.direct_gemms
    ms = {"direct": [], "modules": []}
    try:
        for _ in range(10):
            for name, times in ms.items():
                llama.DecoderLayer.direct_gemms = direct_gemms if name == "direct" else (lambda self, rows: None)
                engine.runner.model.forget_direct_gemms()  # the model keeps its layers' choice per row count
                steps = []
                for _ in range(4):
                    start = time.perf_counter()
                    engine.step()
                    steps.append(time.perf_counter() - start)
                times.append(1e3 * statistics.median(steps))
    finally:
        llama.DecoderLayer.direct_gemms = direct_gemms
        llm.close()
    for name, times in ms.items():
        print(name, " ".join(f"{t:.1f}" for t in times), f"median {statistics.median(times):.1f} ms")
    ratios = [a / b for a, b in zip(ms["direct"], ms["modules"])]
    print("direct / modules per round", " ".join(f"{r:.3f}" for r in ratios), f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
