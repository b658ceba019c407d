"""One call of the compiled decode attention (batch 16 x L tokens, the default model's heads), hot
(the same call repeated) and cold (a 256 MB write between calls, as a step's GEMMs evict the KV),
medians of 30. `python benchmarks/results/decode_kernel/attention_call.py small` (L=270 default;
`huge` madvises the pool for transparent huge pages; env L sets the length). Recorded in
benchmarks/RESULTS.md, issue 13 fourth part."""
import torch, time, statistics, ctypes, sys
from pdserve.kernels import cpu_native
torch.set_num_threads(2)
libc = ctypes.CDLL("libc.so.6", use_errno=True)
def huge(t):
    start = t.data_ptr(); end = start + t.numel() * t.element_size()
    a = (start + (2 << 20) - 1) & ~((2 << 20) - 1); b = end & ~((2 << 20) - 1)
    r = libc.madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), 14)
    assert r == 0, ctypes.get_errno()
    return t
ops = cpu_native.load()
import os
B, L, H, KV, D, BS = 16, int(os.environ.get("L", 270)), 9, 3, 64, 16
nb = B * 18 * 30
use = sys.argv[1] == "huge"
k = torch.empty(nb, BS, KV, D, dtype=torch.bfloat16); v = torch.empty_like(k)
if use: huge(k); huge(v)
k.copy_(torch.randn(nb, BS, KV, D)); v.copy_(torch.randn(nb, BS, KV, D))
perm = torch.randperm(nb)
tables = perm[: B * 18].view(B, 18).int().contiguous()
lens = torch.full((B,), L, dtype=torch.int32)
q = torch.randn(B, H, D).bfloat16(); out = torch.empty_like(q)
seqs = torch.arange(B); rows = torch.arange(B)
flush = torch.randn(64 << 20 >> 2)
for mode in ("hot", "cold"):
    ts = []
    for i in range(30):
        if mode == "cold": flush.add_(1)
        s = time.perf_counter(); ops.decode_attention(q, k, v, tables, lens, seqs, rows, out, 0.125); ts.append(time.perf_counter() - s)
    print(sys.argv[1], mode, statistics.median(ts) * 1e3, "ms")
print(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split("\n")[0])
