"""What a decode step's attention costs inside the step: one engine decodes N sequences (256-token
prompts, greedy) through the Python layers (`compiled_decode` off, so every step asks
`cpu_native.load()` for the compiled ops), and runs of 5 steps take turns with a `load` whose
module has a no-op decode attention (the outputs are then garbage; only the times count). The difference of the
medians is the attention's time in place, after the layer's GEMMs evicted its K/V; the step
without it, over the GEMM floor, says what the rest of the step costs. bf16, the default model.

    python benchmarks/results/ninth/attention_in_step.py 16
"""

import statistics
import sys
import time

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.kernels import cpu_native


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    llm = LLM("smollm2", dtype="bfloat16", num_threads=threads, block_size=16, skip_tokenizer_init=True,
              max_num_seqs=batch, num_kv_blocks=batch * 48, max_model_len=700)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(engine.model_config.vocab_size, (256,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    engine.runner.model.compiled_decode = False
    load = cpu_native.load
    ops = load()

    class NoAttention:
        def __getattr__(self, name):
            return (lambda *args: None) if name == "decode_attention" else getattr(ops, name)

    no_attention = NoAttention()
    times = {"with": [], "without": []}
    try:
        for i in range(200):  # contexts grow from 257 to 456 tokens
            name = "with" if (i // 5) % 2 == 0 else "without"
            cpu_native.load = load if name == "with" else (lambda: no_attention)
            start = time.perf_counter()
            engine.step()
            if i % 5:  # the first step of a run is a warm-up
                times[name].append(time.perf_counter() - start)
    finally:
        cpu_native.load = load
        llm.close()
    a, b = (1e3 * statistics.median(times[k]) for k in ("with", "without"))
    print(f"batch {batch}, {threads} threads: step {a:.2f} ms, without the attention {b:.2f} ms: "
          f"the attention in the step {a - b:.2f} ms")


if __name__ == "__main__":
    main()
