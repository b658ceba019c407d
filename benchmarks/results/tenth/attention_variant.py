"""Issue 13, tenth part: one 512-token prefill_attention call (the default model's 9 heads, 3 KV
heads, head_dim 64) on one thread, the extension built from the work tree with extra -D flags
(comma-separated, may be empty). Run: python attention_variant.py "" """
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from pdserve.kernels import cpu_native

flags = sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1] else []
name = "v_" + "_".join(f.strip("-D").lower() for f in flags) if flags else "v_base"
build = Path(tempfile.gettempdir()) / "pdserve_variants" / name
build.mkdir(parents=True, exist_ok=True)
ops = load(name, cpu_native.cpp_sources(), extra_cflags=[*cpu_native.compile_flags(), *flags],
           extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
if not ops.amx_available():
    sys.exit("no AMX-BF16 on this CPU")
torch.set_num_threads(1)
H, KVH, D, BS, QL = 9, 3, 64, 16, 512
nb = -(-QL // BS)
kc = torch.randn(nb, BS, KVH, D).bfloat16()
vc = torch.randn(nb, BS, KVH, D).bfloat16()
table = torch.arange(nb, dtype=torch.int32)
q = torch.randn(QL, H, D).bfloat16()
out = torch.empty_like(q)
for _ in range(20):
    ops.prefill_attention(q, kc, vc, table, 0, QL, QL, out, 0.125)
times = []
for _ in range(7):
    t = time.perf_counter()
    for _ in range(50):
        ops.prefill_attention(q, kc, vc, table, 0, QL, QL, out, 0.125)
    times.append((time.perf_counter() - t) / 50)
print(name, "ms per call (1 thread)", round(1e3 * sorted(times)[3], 3))
