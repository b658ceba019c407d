"""benchmarks/tp_overhead.py runs end to end on a tiny model and reports every rank's weights."""

from __future__ import annotations

import json

import pytest

from benchmarks import tp_overhead
from tests.conftest import save_tiny_model


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_tp_overhead_reports_per_rank_weights_and_step_times(tmp_path, capsys):
    save_tiny_model(tmp_path / "m", "llama")
    assert tp_overhead.main(["--model", str(tmp_path / "m"), "--tp-sizes", "1,2", "--batch", "2", "--warmup", "1",
                             "--steps", "3", "--prompt-len", "8"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["tp"] for r in rows] == [1, 2]
    full, (rank0, rank1) = rows[0]["param_bytes_per_rank"][0], rows[1]["param_bytes_per_rank"]
    assert rank0 == rank1 and 0.49 * full < rank0 < 0.52 * full
    assert all(r["decode_step_ms_p50"] > 0 for r in rows)
