"""Shared pieces of the speculative-decoding tests: engines over the tiny model, a draft that
agrees with the target part of the time, repetitive prompts that ngram lookup can copy from."""

from __future__ import annotations

import random

from pdserve.engine import LLM

SMALL_POOL_GB = 0.02


def noisy_draft(path, noise: float = 0.05):
    """A draft model: the tiny target's weights plus Gaussian noise (`noise` x each tensor's std), so
    that it proposes what the target would say often but not always."""
    import torch

    from tests.conftest import save_tiny_model

    model = save_tiny_model(path, "llama")
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    model.save_pretrained(path, safe_serialization=True)
    return path


def copy_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a random phrase: ngram lookup finds matches in them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(3, 256) for _ in range(rng.randint(3, 8))]
        out.append((phrase * 6)[: rng.randint(12, 40)])
    return out


def make_llm(model, spec=None, **kw) -> LLM:
    kw.setdefault("kv_cache_memory_gb", SMALL_POOL_GB)
    return LLM(str(model), dtype="float32", num_threads=2, block_size=4, speculative_config=spec, **kw)


def assert_idle(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and not bm.tables and not bm.host_tables
