"""Shared e2e pieces: a tiny random model + tokenizer on disk, transformers' greedy reference."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import save_tiny_model, save_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-e2e")
    model = save_tiny_model(path, "llama")
    tokenizer = save_tiny_tokenizer(path)
    return path, model, tokenizer


def hf_greedy(model, prompt_ids, max_tokens):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_tokens, pad_token_id=258)
    return out[0, len(prompt_ids):].tolist()


def prompts(n, seed=0, lo=1, hi=200):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
