"""Decode step time per KV block size, the engines taking turns in one process (issue 13, eleventh part).

    python benchmarks/results/eleventh/block_size_ab.py BATCH CONTEXT 16,64,128
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: benchmarks
from benchmarks.decoding import start_decodes  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402

batch, ctx, sizes = int(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
torch.set_num_threads(2)
engines = {}
for bs in sizes:
    llm = LLM("smollm2", dtype="bfloat16", num_threads=2, block_size=bs, skip_tokenizer_init=True, max_num_seqs=batch,
              num_kv_blocks=batch * ((ctx + 400) // bs + 2), max_model_len=ctx + 400)
    engine = llm.engine
    start_decodes(engine, batch, ctx, SamplingParams(max_tokens=390, temperature=0, ignore_eos=True))
    engines[bs] = (llm, engine)
times = {bs: [] for bs in sizes}
for i in range(30 * len(sizes)):  # 5 steps of each in turn, the first of each 5 not timed
    bs = sizes[(i // 5) % len(sizes)]
    start = time.perf_counter()
    engines[bs][1].step()
    if i % 5:
        times[bs].append(time.perf_counter() - start)
for bs in sizes:
    print(f"batch {batch} context {ctx} block_size {bs}: {1e3 * statistics.median(times[bs]):.2f} ms a step")
for llm, _ in engines.values():
    llm.close()
