"""The panels GEMM of an earlier commit against the working tree's, on the default model's 120
layer GEMMs and its lm_head (distinct weights, streaming from memory as a step's do), taking
turns 9 times per row count; the old source is built into a temporary directory (~50 s):

    python benchmarks/results/seventh/panels_ab.py dbf2ed9 1,2,3,4,8,16,64
"""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from pdserve.kernels import cpu_native  # noqa: E402

torch.set_num_threads(2)
rev, rows_list = sys.argv[1], [int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,16").split(",")]
build = Path(tempfile.mkdtemp())
(build / "old_decode.cpp").write_text(
    subprocess.run(["git", "show", f"{rev}:pdserve/kernels/cpu_decode.cpp"], cwd=ROOT, check=True,
                   capture_output=True, text=True).stdout)
old = load("old_decode", [str(build / "old_decode.cpp")], extra_cflags=cpu_native._build_dir()[1],
           extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
new = cpu_native.load()


def api(module):  # (pack, gemm): the ops were named pack_bf16_panels / gemm_bf16_panels before
    return (getattr(module, "pack_panels", None) or module.pack_bf16_panels,
            getattr(module, "gemm_panels", None) or module.gemm_bf16_panels)


shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
weights = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
packs = {name: [api(m)[0](w) for w in weights] for name, m in (("old", old), ("new", new))}
for rows in rows_list:
    xs = {k: torch.randn(rows, k) for k in (576, 1536)}
    for (n, k), a, b in zip(shapes[:4], packs["old"], packs["new"]):
        assert torch.equal(api(old)[1](xs[k], a, n, None), api(new)[1](xs[k], b, n, None)), "the same sums"
    res = {"old": [], "new": []}
    for r in range(9):
        for name in ("old", "new") if r % 2 else ("new", "old"):
            gemm = api(old if name == "old" else new)[1]
            start = time.perf_counter()
            for (n, k), p in zip(shapes, packs[name]):
                gemm(xs[k], p, n, None)
            res[name].append(time.perf_counter() - start)
    ratio = statistics.median(a / b for a, b in zip(res["new"], res["old"]))
    print(f"rows {rows}: old {1e3 * statistics.median(res['old']):.2f} ms, new {1e3 * statistics.median(res['new']):.2f} ms, "
          f"new / old paired {ratio:.3f}")
