"""benchmarks/decode_kernel_ab.py alternates the compiled decode kernel and the torch path step by
step in one engine, and reports both medians."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import decode_kernel_ab
from pdserve.kernels import cpu_native
from tests.conftest import TINY_SHAPE, save_tiny_model


class _Counting:
    """Stands in for the loaded extension: counts the kernel's calls, then runs it."""

    def __init__(self, module):
        self.module, self.calls = module, 0

    def decode_attention(self, *args):
        self.calls += 1
        return self.module.decode_attention(*args)


@pytest.mark.timeout(180)
def test_the_variants_take_turns_and_both_are_reported(tmp_path, capsys, monkeypatch):
    module = cpu_native.load()
    assert module is not None
    counting = _Counting(module)
    monkeypatch.setitem(cpu_native._state, "module", counting)
    save_tiny_model(tmp_path / "m", "llama")
    out = tmp_path / "ab.json"
    steps = 3
    assert decode_kernel_ab.main(["--model", str(tmp_path / "m"), "--dtype", "float32", "--batch-sizes", "1,2",
                                  "--context-len", "20", "--num-threads", "1", "--steps", str(steps),
                                  "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["kernel_ms"] > 0 and r["torch_ms"] > 0 and r["ratio"] == pytest.approx(r["kernel_ms"] / r["torch_ms"])
    # every layer of every kernel step (the warm-up one included) called it; no torch step did
    assert counting.calls == 2 * (steps + 1) * TINY_SHAPE["num_hidden_layers"]
    assert cpu_native.NATIVE_ENV not in os.environ
    assert "kernel" in capsys.readouterr().out
