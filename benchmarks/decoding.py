"""A running batch for the decode-step benchmarks: requests of random prompts, prefilled."""

from __future__ import annotations

import torch


def start_decodes(engine, batch: int, context_len: int, params, seed: int = 0) -> None:
    """Add `batch` requests of `context_len` seeded random token ids with `params` to `engine` and
    step it until every one has its first token: from then on each step decodes one token for each
    (the step the benchmarks time)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        engine.add_request(torch.randint(engine.model_config.vocab_size, (context_len,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
