"""The default model's 121 bf16 decode GEMMs (30 layers x qkv, o, gate_up, down, and the lm_head) on
distinct random weights, per path, at the row counts given: oneDNN on a reordered bf16 copy (dnn),
the panels GEMM (pan, fp32 in), F.linear (lin) and the AMX tiles (amx, where the CPU has AMX).
Medians of 7 rounds, the paths taking turns within each. NT=1 for one thread.

    python benchmarks/results/eighth/gemm_rows.py 1,2,4,8,16,32,64,128,512
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native

SHAPES = [(576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1)]  # (in, out, count)


def paths(rows: int, ops, g: torch.Generator) -> dict:
    weights = [(torch.randn(n, k, generator=g) * k**-0.5).bfloat16() for k, n, count in SHAPES for _ in range(count)]
    xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k, _, _ in SHAPES}
    calls = {"dnn": [], "pan": [], "lin": [], "amx": []}
    for w in weights:
        n, k = w.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        calls["dnn"].append((lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), xs[k]))
        panels = ops.pack_panels(w)
        calls["pan"].append((lambda x, p=panels, n=n: ops.gemm_panels(x, p, n, None), xs[k].float()))
        calls["lin"].append((lambda x, w=w: F.linear(x, w), xs[k]))
        if ops.amx_available():
            tiles = ops.pack_tiles(w)
            calls["amx"].append((lambda x, t=tiles, n=n: ops.gemm_tiles(x, t, n, None, True), xs[k]))
    return {name: c for name, c in calls.items() if c}


def main() -> None:
    torch.set_num_threads(int(os.environ.get("NT", "2")))
    ops = cpu_native.load()
    g = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in sys.argv[1].split(",")):
        calls = paths(rows, ops, g)
        times = {name: [] for name in calls}
        with torch.inference_mode():
            for i in range(8):
                for name, seq in calls.items():
                    start = time.perf_counter()
                    for f, x in seq:
                        f(x)
                    if i:
                        times[name].append(time.perf_counter() - start)
        print(rows, {name: round(1e3 * statistics.median(t), 2) for name, t in times.items()})


if __name__ == "__main__":
    main()
