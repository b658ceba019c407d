"""On one GPU: a prefill and a decode process hand KV over by CUDA IPC, and greedy outputs equal a
colocated run. Skipped without a GPU (the CPU counterpart is test_disaggregated.py, shared memory)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.stack import Stack
from tests.e2e.test_disaggregated import completion, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.e2e,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in gpu_check.sh)"),
              pytest.mark.timeout(300)]  # two stacks, each node initialising CUDA and capturing graphs

# --max-num-seqs 16: each node captures 5 decode CUDA graphs at start-up instead of 35.
GPU_FLAGS = ["--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3", "--max-num-seqs", "16"]


def test_disaggregated_over_cuda_ipc_equals_colocated(tmp_path):
    from benchmarks.make_random_model import make

    make("smollm2", str(tmp_path), "bfloat16")
    ps = prompts(8, seed=5, lo=16, hi=400)
    outs = {}
    for mode, kw in (("disagg", {}), ("colocated", {"colocated": True, "num_nodes": 1})):
        s = Stack(str(tmp_path), extra=GPU_FLAGS, timeout=600, **kw)
        try:
            outs[mode] = [completion(s, p, max_tokens=32, ignore_eos=True)["choices"][0]["token_ids"] for p in ps]
            if mode == "disagg":
                decode = next(st for st in s.node_status() if st["role"] == "decode")
                assert decode["timings"], "the decode node received no KV"
        finally:
            s.close()
    assert outs["disagg"] == outs["colocated"]
