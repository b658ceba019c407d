"""Issue 13, fifteenth part: where one prefill_attention call's time goes. The kernel sources are
copied to a scratch directory, attention_parts.patch (preprocessor switches that compile a part
out: PDX_NO_SCORES, PDX_NO_PV, PDX_NO_EXP, PDX_NO_MAX, PDX_NO_PSTORE, PDX_L1KV) applied there, and
each flag set built as its own module; the modules take turns in one process (10 calls a turn),
and each prints its median time and its median ratio to the first. Outputs of parts compiled out
are wrong by design; a set with no flags is checked bit for bit against the first.

    python benchmarks/results/fifteenth/attention_parts.py "" -DPDX_NO_SCORES -DPDX_NO_SCORES,-DPDX_NO_PV

Environment: T threads (1), QL query tokens (512), R turns (21). The default model's shape: 9
heads, 3 KV heads, head_dim 64, 16-token blocks, one request's prompt of QL tokens.
"""

import atexit
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from pdserve.kernels import cpu_native

HERE = Path(__file__).resolve().parent
torch.set_num_threads(int(os.environ.get("T", "1")))
H, KVH, D, BS = 9, 3, 64, 16
QL, TURNS = int(os.environ.get("QL", "512")), int(os.environ.get("R", "21"))

source = Path(tempfile.mkdtemp(prefix="attention_parts_"))
atexit.register(shutil.rmtree, source, True)  # the copies and builds, on every exit
for path in cpu_native.cpp_sources():
    shutil.copy(path, source)
for header in Path(cpu_native.cpp_sources()[0]).parent.glob("*.h"):
    shutil.copy(header, source)
subprocess.run(["patch", "-s", "-p3", "-d", str(source), "-i", str(HERE / "attention_parts.patch")], check=True)

mods = []
for arg in sys.argv[1:] or [""]:
    flags = [f for f in arg.split(",") if f]
    name = "parts_" + ("_".join(f.removeprefix("-DPDX_").lower() for f in flags) or "none")
    build = source / name
    build.mkdir()
    sources = [str(source / Path(p).name) for p in cpu_native.cpp_sources()]
    mods.append((name, flags, load(name, sources, extra_cflags=[*cpu_native.compile_flags(), *flags],
                                   extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)))
if not mods[0][2].amx_available():
    sys.exit("no AMX-BF16 on this CPU")

blocks = -(-QL // BS)
kc, vc = torch.randn(blocks, BS, KVH, D).bfloat16(), torch.randn(blocks, BS, KVH, D).bfloat16()
table = torch.arange(blocks, dtype=torch.int32)
q = torch.randn(QL, H, D).bfloat16()
out = torch.empty_like(q)


def run(ops, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        ops.prefill_attention(q, kc, vc, table, 0, QL, QL, out, 0.125)
    return (time.perf_counter() - start) / calls


reference = None
for name, flags, ops in mods:
    run(ops, 20)
    out.zero_()
    ops.prefill_attention(q, kc, vc, table, 0, QL, QL, out, 0.125)
    if reference is None:
        reference = out.clone()
    elif not flags:
        assert torch.equal(out, reference), f"{name}: not the same bits"
times = {name: [] for name, _, _ in mods}
for _ in range(TURNS):
    for name, _, ops in mods:
        times[name].append(run(ops, 10))
first = times[mods[0][0]]
print(f"prefill_attention, {QL} tokens, {torch.get_num_threads()} thread(s), medians of {TURNS} turns of 10 calls")
for name, _, _ in mods:
    ratio = statistics.median(a / b for a, b in zip(times[name], first))
    print(f"{name:50s} {1e3 * statistics.median(times[name]):7.3f} ms   / first {ratio:.3f}")
