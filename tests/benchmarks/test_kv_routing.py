"""benchmarks/kv_routing.py runs (small) and reports what it says it measures."""

from __future__ import annotations

import json

import pytest

from benchmarks import kv_routing

pytestmark = pytest.mark.timeout(120)


def test_kv_routing_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    kv_routing.main(["--blocks", "2000", "--prefixes", "10", "--prefill", "2", "--decode", "2", "--rate", "100",
                     "--seconds", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["indexed"]["requests"] == result["no_index"]["requests"] == 100
    assert 1000 <= result["indexed"]["index_blocks"] <= 2000
    for part in (result["indexed"]["route"], result["indexed"]["apply"], result["no_index"]["route"]):
        assert 0 < part["p50_us"] <= part["p99_us"] <= part["max_us"]
