"""A 512-token prefill step (one request, max_tokens 1) with the panels GEMM capped at 64 rows
(oneDNN runs the chunk) against no cap (the panels run it), the two taking turns in one engine, 8
rounds (the first not counted):

    python benchmarks/results/seventh/prefill_ab.py bfloat16 512      (or float32)
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.parallel import layers  # noqa: E402

dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
n = int(sys.argv[2]) if len(sys.argv) > 2 else 512
llm = LLM("smollm2", dtype=dtype, num_threads=2, max_num_seqs=1, block_size=16, num_kv_blocks=n // 16 + 8,
          max_num_batched_tokens=n, skip_tokenizer_init=True, max_model_len=n + 2)
engine = llm.engine
g = torch.Generator().manual_seed(0)
params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
times: dict[int, list[float]] = {64: [], 1 << 20: []}
try:
    for r in range(8):
        for cap in (64, 1 << 20) if r % 2 else (1 << 20, 64):
            layers.PANEL_MAX_ROWS = cap
            engine.runner.model.forget_direct_gemms()
            engine.add_request(torch.randint(engine.model_config.vocab_size, (n,), generator=g).tolist(), params)
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            assert not engine.has_unfinished(), "the prompt is prefilled in one step"
            if r:
                times[cap].append(elapsed)
finally:
    llm.close()
ratio = statistics.median(a / b for a, b in zip(times[1 << 20], times[64]))
print(f"{dtype}, {n} tokens: oneDNN {1e3 * statistics.median(times[64]):.0f} ms, "
      f"panels {1e3 * statistics.median(times[1 << 20]):.0f} ms, panels / oneDNN paired {ratio:.3f}")
