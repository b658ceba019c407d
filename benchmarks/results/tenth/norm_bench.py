"""Issue 13, tenth part: add_rms_norm of [rows, 576] (bf16 residual) on N threads, median us of 200
calls, and a clone of the same rows for scale. Run: python norm_bench.py 2"""
import sys
import time

import torch

from pdserve.kernels import cpu_native

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
ops = cpu_native.load()
H = 576


def median_us(f, n=200):
    for _ in range(20):
        f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return round(sorted(times)[n // 2] * 1e6, 1)


for rows in (512, 2048):
    for delta_dtype in (torch.bfloat16, torch.float32):
        res = torch.randn(rows, H).bfloat16()
        delta = torch.randn(rows, H).to(delta_dtype)
        w32 = torch.randn(H)
        for fp32_out in (True, False):
            w = w32 if fp32_out else w32.bfloat16()
            us = median_us(lambda: ops.add_rms_norm(res, delta, w, 1e-5, fp32_out))  # noqa: B023
            print(rows, delta_dtype, "fp32_out" if fp32_out else "bf16_out", us, "us")
    x = torch.randn(rows, H).bfloat16()
    print(rows, "clone", median_us(x.clone), "us")
