"""benchmarks/decode_kernel_ab.py alternates the compiled CPU ops (decode kernel, fused layer ops) and
the torch code step by step in one engine, and reports both medians."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import decode_kernel_ab
from pdserve.kernels import cpu_native
from tests.conftest import TINY_SHAPE, save_tiny_model
from tests.kernels.test_cpu_layer_ops import CountingOps


@pytest.mark.timeout(180)
def test_the_variants_take_turns_and_both_are_reported(tmp_path, capsys, monkeypatch):
    module = cpu_native.load()
    assert module is not None
    counting = CountingOps(module)
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
    # every layer of every kernel step (the warm-up one included) called each op; no torch step did.
    # The layer ops also ran in each batch size's one prefill step (before the timed steps, ops on),
    # where decode attention has no row to compute; each of those steps sampled greedily by the
    # compiled argmax.
    kernel_steps = 2 * (steps + 1)
    forwards = kernel_steps + 2
    layers = TINY_SHAPE["num_hidden_layers"]
    assert counting.calls == {"decode_attention": kernel_steps * layers, "rope_store_kv": forwards * layers,
                              "silu_mul": forwards * layers, "add_rms_norm": forwards * (2 * layers + 1),
                              "argmax_rows": forwards}
    assert cpu_native.NATIVE_ENV not in os.environ
    assert "kernel" in capsys.readouterr().out
