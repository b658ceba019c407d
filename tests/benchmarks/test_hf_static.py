"""transformers static batching measured like a server: one record per prompt, TTFT grows batch by
batch, every request gets exactly its output length."""

from __future__ import annotations

import torch

from pdserve.bench.datasets import random_requests
from pdserve.bench.hf_static import run_static_batches
from tests.conftest import save_tiny_model


def test_static_batches_produce_server_shaped_records(tmp_path):
    torch.set_num_threads(1)
    model = save_tiny_model(tmp_path, "llama")
    samples = random_requests(5, 12, 4, 0.0, vocab_size=256, seed=0)
    run = run_static_batches(model, samples, batch_size=2, pad_token_id=258)
    assert sorted(r.request_id for r in run.records) == list(range(5)) and run.duration_s > 0
    assert all(r.success and r.output_len == 4 and len(r.itl_s) == 3 for r in run.records)
    ttft = {r.request_id: r.ttft_s for r in run.records}
    assert ttft[0] == ttft[1] < ttft[2] == ttft[3] < ttft[4]  # a batch waits for the ones before it
    assert all(r.e2el_s >= r.ttft_s + sum(r.itl_s) - 1e-9 for r in run.records)
