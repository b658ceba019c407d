"""The gate_up GEMM with SiLU x up fused (Tiles(silu=True)) against the unfused GEMM then silu_mul,
in one engine, taking turns: prefill steps of N tokens one by one, or decode steps of N sequences
(256-token prompts) in runs of 5. Medians; a CPU with AMX only.

    python benchmarks/results/eighth/silu_ab.py 512 2 prefill
    python benchmarks/results/eighth/silu_ab.py 16 2 decode
"""

import statistics
import sys
import time

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.parallel.layers import Tiles
from pdserve.kernels import cpu_native


def main() -> None:
    n, threads, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(threads)
    kw = (dict(max_num_seqs=1, num_kv_blocks=n // 16 + 3, max_model_len=n + 2, max_num_batched_tokens=max(n, 2048))
          if mode == "prefill" else dict(max_num_seqs=n, num_kv_blocks=n * 40, max_model_len=600))
    llm = LLM("smollm2", dtype="bfloat16", num_threads=threads, block_size=16, skip_tokenizer_init=True, **kw)
    engine, model = llm.engine, llm.engine.runner.model
    fused = [layer.mlp.gate_up_silu for layer in model.layers]
    assert all(f is not None for f in fused), "no fused gate_up here (no AMX?)"
    plain = [Tiles(cpu_native.load(), layer.mlp.gate_up_proj.weight) for layer in model.layers]

    def use(on: bool) -> None:
        for layer, f, p in zip(model.layers, fused, plain):
            layer.mlp.gate_up_silu, layer.mlp.gate_up_proj.tiles = (f, None) if on else (None, p)
        model.forget_direct_gemms()

    g = torch.Generator().manual_seed(0)
    times = {True: [], False: []}
    if mode == "prefill":
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for i in range(16):
            use(i % 2 == 0)
            engine.add_request(torch.randint(49152, (n,), generator=g).tolist(), params)
            start = time.perf_counter()
            engine.step()
            if i >= 2:
                times[i % 2 == 0].append(time.perf_counter() - start)
    else:
        params = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
        for _ in range(n):
            engine.add_request(torch.randint(49152, (256,), generator=g).tolist(), params)
        while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()
        for i in range(60):
            on = (i // 5) % 2 == 0
            use(on)
            start = time.perf_counter()
            engine.step()
            if i % 5:
                times[on].append(time.perf_counter() - start)
    print(mode, n, threads, "fused", round(1e3 * statistics.median(times[True]), 2),
          "unfused", round(1e3 * statistics.median(times[False]), 2))
    llm.close()


if __name__ == "__main__":
    main()
