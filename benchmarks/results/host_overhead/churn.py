"""Host work of a decode node's steps under churn (issue 13, sixth part): B requests decoding;
every step some finish (staggered max_tokens) and as many join with their prompt KV from
elsewhere (add_remote -> remote_kv_done; the blocks hold whatever they hold: timing only), on
the 1-layer hidden-64 model of benchmarks/host_overhead.py. Three paths alternate in runs of 10
steps (the first of each run not counted): columns carried across the churn
(`DecodeBatch.following`), columns rebuilt whenever the running list changes, the general path.
Medians of the host time (step - forward) and its phases, in ms.

    python benchmarks/results/host_overhead/churn.py 256
"""
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.host_overhead import make_model
from pdserve.engine import decode_batch
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

B = int(sys.argv[1]) if len(sys.argv) > 1 else 256
model = make_model(Path(tempfile.mkdtemp()) / "m")
cfg = EngineConfig(model, dtype="float32", max_num_seqs=B, block_size=16, num_kv_blocks=B * 12 + 1,
                   max_num_batched_tokens=max(2048, B * 8))
orig = decode_batch.DecodeBatch.following.__func__
def rebuild(cls, old, requests, eos, carried):
    return cls(requests, eos), None
ids = itertools.count()
with LLMEngine(cfg) as engine:
    sched = engine.scheduler
    def arrive(out_len):
        prompt = [(7 * j) % 509 + 3 for j in range(8)]
        r = Request(f"c{next(ids)}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
        r.append_output(5)
        sched.add_remote(r)
    for i in range(B):
        arrive(20 + (i * 97) % 128)
    samples = {}
    modes = ("following", "rebuild", "general")
    for i in range(30 * 10 * len(modes) + 50):
        mode = modes[(i // 10) % len(modes)]
        sched.decode_columns = mode != "general"
        decode_batch.DecodeBatch.following = classmethod(orig if mode == "following" else rebuild)
        while len(sched.running) + len(sched.receiving_kv) + len(sched.waiting_for_kv) < B:
            arrive(64 + len(sched.requests) % 64)
        for r in sched.schedule_remote_kv():
            sched.remote_kv_done(r.request_id)
        engine.step_requests()
        if i < 50 or i % 10 == 0:
            continue
        samples.setdefault(mode, []).append(engine.timings.host * 1e3)
        for ph in ("schedule", "prepare", "sample", "output"):
            samples.setdefault(mode + "." + ph, []).append(getattr(engine.timings, ph) * 1e3)
    for mode in modes:
        print(f"{mode:>9}: host {statistics.median(samples[mode]):.3f} ms  " + "  ".join(
            f"{ph} {statistics.median(samples[mode + '.' + ph]):.3f}" for ph in ("schedule", "prepare", "sample", "output")))
