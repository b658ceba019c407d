"""Shared factories: small plain-value builders for requests, block managers, schedulers and tiny
random Hugging Face models saved to disk (never downloaded); and the slow tier's timeout.

Timeouts (pytest-timeout, method "signal": pyproject.toml): every test has one. The default (60 s)
suits the fast tier; a test marked `slow` gets SLOW_TIMEOUT_S unless it carries its own
`@pytest.mark.timeout(...)`, and a `--timeout` on the command line (or PYTEST_TIMEOUT) applies to
every test alike (`--timeout 0` turns them off, e.g. under a debugger).
"""

from __future__ import annotations

import itertools
import os

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

# Two cores: keep torch from oversubscribing them in test processes.
os.environ.setdefault("OMP_NUM_THREADS", "2")

_ids = itertools.count()

SLOW_TIMEOUT_S = 600  # a slow test that has no timeout marker of its own


def pytest_collection_modifyitems(config, items):
    if config.getoption("timeout", None) is not None or os.environ.get("PYTEST_TIMEOUT"):
        return  # an explicit timeout for this run wins over the tiers
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def make_request(prompt_token_ids=None, *, num_tokens: int = 8, max_tokens: int = 16, priority: int = 0,
                 request_id: str | None = None, **params) -> Request:
    if prompt_token_ids is None:
        prompt_token_ids = list(range(1, num_tokens + 1))
    return Request(
        request_id if request_id is not None else f"req-{next(_ids)}",
        list(prompt_token_ids),
        SamplingParams(max_tokens=max_tokens, **params),
        priority=priority,
    )


def make_block_manager(num_blocks: int = 16, block_size: int = 4, **kw) -> BlockManager:
    kw.setdefault("watermark", 0.0)
    return BlockManager(num_blocks, block_size, **kw)


def make_scheduler(num_blocks: int = 16, block_size: int = 4, *, num_host_blocks: int = 0,
                   enable_prefix_caching: bool = True, eos_token_ids=(), **kw) -> Scheduler:
    kw.setdefault("max_model_len", num_blocks * block_size)
    bm = make_block_manager(num_blocks, block_size, num_host_blocks=num_host_blocks,
                            enable_prefix_caching=enable_prefix_caching)
    return Scheduler(SchedulerConfig(**kw), bm, eos_token_ids)


def assert_no_leak(block_manager: BlockManager) -> None:
    """The end-of-scenario check: books balance and no block or host block is held."""
    block_manager.check_invariants()
    assert block_manager.num_used_blocks == 0, f"{block_manager.num_used_blocks} blocks still in use"
    assert not block_manager.tables and not block_manager.host_tables


@pytest.fixture
def no_leak():
    return assert_no_leak


# ---- tiny random Hugging Face models ------------------------------------------------------
TINY_SHAPE = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def save_tiny_model(path, arch: str = "llama", **overrides):
    """Build a tiny random model of `arch` (llama, qwen2, mistral) and save_pretrained it (safetensors).
    The init scale is raised so logits are far from ties and greedy parity is a sharp test."""
    import torch
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[arch]
    shape = dict(TINY_SHAPE, initializer_range=0.08, bos_token_id=256, eos_token_id=257, pad_token_id=258,
                 tie_word_embeddings=arch == "qwen2")
    shape.update(overrides)
    config = cls[0](**shape)
    torch.manual_seed(1234)
    model = cls[1](config).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def save_tiny_tokenizer(path):
    """A byte-level tokenizer matching the tiny models: ids 0..255 are bytes (so multi-byte
    characters span tokens), 256/257/258 are <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(path, "llama")
    save_tiny_tokenizer(path)
    return path
