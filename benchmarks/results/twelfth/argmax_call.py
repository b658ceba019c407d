"""One call on 1, 16 and 64 rows of 49,152 bf16 logits: the compiled argmax_rows against the float32
copy then numpy's argmax (the greedy path before), warm and after a 128 MB read (medians of 50 / 20;
issue 13, twelfth part).

    python benchmarks/results/twelfth/argmax_call.py
"""

import statistics
import time

import torch

from pdserve.kernels import cpu_native

ops = cpu_native.load()
torch.set_num_threads(2)
big = torch.ones(32 * 2**20)


def median_ms(f, n: int, cold: bool = False) -> float:
    times = []
    for _ in range(n):
        if cold:
            big.sum()
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


for rows in (1, 16, 64):
    x = torch.randn(rows, 49152, generator=torch.Generator().manual_seed(rows)).bfloat16()

    def old(x=x):
        return x.float().numpy().argmax(1)

    def new(x=x):
        return ops.argmax_rows(x)

    assert new().tolist() == old().tolist()
    print(f"{rows:3d} rows: warm {median_ms(new, 50):.3f} ms against {median_ms(old, 50):.3f}; "
          f"after a 128 MB read {median_ms(new, 20, True):.3f} against {median_ms(old, 20, True):.3f}")
