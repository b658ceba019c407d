"""The panels GEMM (kernels/cpu_decode.cpp: gemm_panels, bf16 weights) against oneDNN's reordered
fp32 copy, on the default model's 120 layer GEMMs (30 distinct weights of each shape, so they
stream from memory as a step's do), taking turns 5 times per row count:

    python benchmarks/results/seventh/panels_vs_onednn.py 16,64,128,256,512
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pdserve.kernels import cpu_native  # noqa: E402

torch.set_num_threads(2)
ops = cpu_native.load()
lin = torch.ops.mkldnn._linear_pointwise
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
w16s = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
panels = [ops.pack_panels(w) for w in w16s]
packed = [torch.ops.mkldnn._reorder_linear_weight(w.float(), 16) for w in w16s]
for rows in [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "16,64").split(",")]:
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    res = {"panels": [], "onednn": []}
    for _ in range(5):
        start = time.perf_counter()
        for w, (n, _) in zip(panels, shapes):
            ops.gemm_panels(xs[w.shape[1]], w, n, None)
        res["panels"].append(time.perf_counter() - start)
        start = time.perf_counter()
        for p, w in zip(packed, w16s):
            lin(xs[w.shape[1]], p, None, "none", [], "")
        res["onednn"].append(time.perf_counter() - start)
    ratio = statistics.median(a / b for a, b in zip(res["panels"], res["onednn"]))
    flops = 2 * rows * sum(n * k for n, k in shapes)
    p, o = statistics.median(res["panels"]), statistics.median(res["onednn"])
    print(f"rows {rows}: panels {1e3 * p:.1f} ms ({flops / p / 1e9:.0f} GFLOP/s), oneDNN {1e3 * o:.1f} ms "
          f"({flops / o / 1e9:.0f} GFLOP/s), panels / oneDNN paired {ratio:.3f}")
