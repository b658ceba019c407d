"""benchmarks/serving.py: how 1P+1D shares the machine's cores, and one small run of the whole thing
(a stack of two nodes on a tiny random model, its JSON)."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import serving


def threads(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"num_threads": None, "decode_threads": None, "prefill_threads": None} | kw))


def test_1p1d_shares_the_cores_decode_on_all_of_them(monkeypatch):
    monkeypatch.setattr(serving.os, "cpu_count", lambda: 8)
    assert serving.disagg_threads(threads()) == (8, 4)
    assert serving.disagg_threads(threads(decode_threads=6, prefill_threads=2)) == (6, 2)
    assert serving.disagg_threads(threads(num_threads=3)) == (3, 3)  # --num-threads alone: both nodes
    assert serving.disagg_threads(threads(num_threads=3, prefill_threads=1)) == (3, 1)
    monkeypatch.setattr(serving.os, "cpu_count", lambda: 1)
    assert serving.disagg_threads(threads()) == (1, 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_small_disaggregated_run_writes_its_figures(tiny_llama, tmp_path):
    out = tmp_path / "serving.json"
    assert serving.main(["--model", str(tiny_llama), "--dtype", "float32", "--modes", "disagg", "--num-requests", "4",
                         "--input-len", "8", "--output-len", "5", "--concurrency", "2", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["disagg"]["output_tokens"] == 20 and doc["disagg"]["output_tok_per_s"] > 0
