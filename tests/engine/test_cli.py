"""Engine flags as the node command lines resolve them."""

from __future__ import annotations

import pytest

from pdserve.engine.args import CPU_PREFILL_BATCHED_TOKENS, DEFAULT_BATCHED_TOKENS, engine_kwargs


def _node_args(module: str, argv: list[str]):
    if module == "prefill":
        from pdserve.prefill_node.__main__ import build_parser
    else:
        from pdserve.decode_node.__main__ import build_parser
    return build_parser().parse_args(["--router", "tcp://127.0.0.1:1", *argv])


@pytest.mark.parametrize(("module", "argv", "expected"), [
    ("prefill", [], CPU_PREFILL_BATCHED_TOKENS),  # a CPU prefill node takes smaller steps
    ("prefill", ["--device", "cuda"], DEFAULT_BATCHED_TOKENS),
    ("prefill", ["--role", "both"], DEFAULT_BATCHED_TOKENS),  # colocated: it decodes too
    ("prefill", ["--no-enable-chunked-prefill"], DEFAULT_BATCHED_TOKENS),  # a step holds whole prompts
    ("prefill", ["--max-num-batched-tokens", "4096"], 4096),  # an explicit value always wins
    ("decode", [], DEFAULT_BATCHED_TOKENS),
    ("decode", ["--max-num-batched-tokens", "256"], 256),
])
def test_max_num_batched_tokens_default_depends_on_role_and_device(module, argv, expected):
    assert engine_kwargs(_node_args(module, argv))["max_num_batched_tokens"] == expected
    assert CPU_PREFILL_BATCHED_TOKENS < DEFAULT_BATCHED_TOKENS


def test_offline_commands_keep_the_engine_default():
    import argparse

    from pdserve.engine.args import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["max_num_batched_tokens"] == DEFAULT_BATCHED_TOKENS
