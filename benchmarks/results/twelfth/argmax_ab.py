"""A decode step with the old greedy sampling (the lm_head's bf16 logits upcast to float32 in
compute_logits, numpy's argmax) against the new (bf16 logits, the compiled argmax_rows), taking
turns every 5 steps in one engine (issue 13, twelfth part). Prints the step's, the forward's and
the sample phase's medians.

    python benchmarks/results/twelfth/argmax_ab.py BATCH CONTEXT
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root: benchmarks
import pdserve.engine.model_runner as model_runner  # noqa: E402
from benchmarks.decoding import start_decodes  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402

batch, ctx = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(2)
llm = LLM("smollm2", dtype="bfloat16", num_threads=2, block_size=16, skip_tokenizer_init=True, max_num_seqs=batch,
          num_kv_blocks=batch * (ctx // 16 + 30), max_model_len=ctx + 450)
engine = llm.engine
model = engine.runner.model
start_decodes(engine, batch, ctx, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
new = (model.compute_logits, model_runner.argmax_rows)


def old_logits(hidden):
    return new[0](hidden).float()


def old_argmax(logits):
    return torch.from_numpy(logits.numpy().argmax(1))


times = {"old": [], "new": []}
phases = {"old": [], "new": []}
for i in range(300):
    name = "old" if (i // 5) % 2 == 0 else "new"
    model.compute_logits, model_runner.argmax_rows = (old_logits, old_argmax) if name == "old" else new
    start = time.perf_counter()
    engine.step()
    spent = time.perf_counter() - start
    if i % 5:  # the first step after a switch is left out
        times[name].append(spent)
        phases[name].append((engine.timings.forward, engine.timings.sample))
o, n = (1e3 * statistics.median(times[k]) for k in ("old", "new"))
f = {k: [1e3 * statistics.median(x[j] for x in phases[k]) for j in (0, 1)] for k in phases}
print(f"batch {batch} ctx {ctx}: old {o:.2f} ms (forward {f['old'][0]:.2f}, sample {f['old'][1]:.3f})  "
      f"new {n:.2f} ms (forward {f['new'][0]:.2f}, sample {f['new'][1]:.3f})  new/old {n / o:.3f}")
llm.close()
