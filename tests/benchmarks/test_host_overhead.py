"""benchmarks/host_overhead.py runs end to end at a tiny size; its phases account for each step."""

from __future__ import annotations

import json

import pytest

from benchmarks import host_overhead
from pdserve.engine.step_timings import PHASES


@pytest.mark.timeout(120)
def test_host_overhead_reports_every_phase_and_they_sum_to_the_total(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert host_overhead.main(["--batch-sizes", "4", "--steps", "6", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["shape"]["num_hidden_layers"] == 1 and report["shape"]["hidden_size"] == 64
    (row,) = report["results"]
    assert (row["batch"], row["steps"], row["repeats"]) == (4, 6, 2)
    for stat in ("median_ms", "mean_ms"):
        assert set(row[stat]) == {*PHASES, "total", "host"}
        assert all(row[stat][name] > 0 for name in PHASES), row[stat]
    mean = row["mean_ms"]
    # The phases are consecutive marks inside the step: together they are the step, less the
    # few calls between them.
    assert 0.9 * mean["total"] <= sum(mean[name] for name in PHASES) <= mean["total"] * 1.0001
    assert mean["host"] == pytest.approx(mean["total"] - mean["forward"])
    assert "batch" in capsys.readouterr().out


def test_engine_step_timings_cover_the_step(tiny_llama):
    """The timings a step leaves on the engine are its own: positive, and summing to its total."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    with LLMEngine(EngineConfig(tiny_llama, dtype="float32", num_kv_blocks=16)) as engine:
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            t = engine.timings
            parts = [getattr(t, name) for name in PHASES]
            assert all(p > 0 for p in parts) and sum(parts) <= t.total + 1e-9
            assert t.host == pytest.approx(t.total - t.forward)


def _reference_batch(chunks, block_size):
    """The batch built the plain way, one token at a time (what host_batch vectorises)."""
    import torch

    tokens, positions, slots, logits, qsl = [], [], [], [], [0]
    width = max(len(c[2]) for c in chunks)
    for token_ids, start, table, num_logits in chunks:
        for j, token_id in enumerate(token_ids):
            pos = start + j
            tokens.append(token_id)
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        logits += range(len(tokens) - num_logits, len(tokens))
        qsl.append(len(tokens))
    return dict(input_ids=tokens, positions=positions, query_start_loc=qsl, slot_mapping=slots,
                seq_lens=[c[1] + len(c[0]) for c in chunks], logits_indices=logits,
                block_tables=[c[2] + [-1] * (width - len(c[2])) for c in chunks],
                max_query_len=max(len(c[0]) for c in chunks), max_seq_len=max(c[1] + len(c[0]) for c in chunks),
                dtypes=dict(input_ids=torch.int64, positions=torch.int64, query_start_loc=torch.int32,
                            seq_lens=torch.int32, block_tables=torch.int32, slot_mapping=torch.int32,
                            logits_indices=torch.int64))


@pytest.mark.parametrize("decode", [True, False])
def test_host_batch_matches_the_plain_construction(decode):
    """Decode steps (one token each) and ragged ones (prefill chunks, drafts, chunks that do not
    sample): every tensor of the vectorised build equals the token-by-token one."""
    import random

    from pdserve.engine.host_batch import build_host_batch, pad_tables

    rng, block_size = random.Random(7), 4
    for _ in range(50):
        chunks = []
        for _ in range(rng.randint(1, 9)):
            start, num = rng.randint(0, 30), 1 if decode else rng.randint(1, 9)
            table = rng.sample(range(100), -(-(start + num) // block_size) + rng.randint(0, 2))
            chunks.append(([rng.randrange(500) for _ in range(num)], start, table, rng.randint(0, min(num, 3))))
        every_logit = decode and all(c[3] == 1 for c in chunks)
        batch = build_host_batch(
            [t for c in chunks for t in c[0]], [c[1] for c in chunks], pad_tables([c[2] for c in chunks]), block_size,
            None if decode else [len(c[0]) for c in chunks], None if every_logit else [c[3] for c in chunks])
        want = _reference_batch(chunks, block_size)
        for name, dtype in want.pop("dtypes").items():
            got = getattr(batch, name)
            assert got.dtype == dtype and got.tolist() == want[name], name
        assert (batch.max_query_len, batch.max_seq_len) == (want["max_query_len"], want["max_seq_len"])


def test_persistent_block_tables_follow_every_kind_of_table_change():
    """Over random steps (blocks appended, replaced in place as a copy-on-write does, popped as a
    speculative roll-back does, requests leaving, joining, reordered, ids used again), the kept
    rows always gather to the step's own tables; more requests than rows, or longer tables than
    columns, grow the table."""
    import random
    from types import SimpleNamespace

    from pdserve.engine.host_batch import pad_tables
    from pdserve.engine.input_batch import PersistentBlockTables

    rng = random.Random(3)
    kept = PersistentBlockTables(num_rows=4, num_blocks=2)
    tables = {f"r{i}": [rng.randrange(1000)] for i in range(6)}
    for _ in range(400):
        rid = rng.choice(list(tables))
        change = rng.randrange(5)
        if change == 0:
            tables[rid].append(rng.randrange(1000))
        elif change == 1:
            tables[rid][rng.randrange(len(tables[rid]))] = rng.randrange(1000)
        elif change == 2 and len(tables[rid]) > 1:
            tables[rid].pop()
        elif change == 3:
            tables[rid] = [rng.randrange(1000)]  # left and came back (or a new request under the same id)
        ids = rng.sample(sorted(tables), rng.randint(1, len(tables)))
        scheduled = [SimpleNamespace(request=SimpleNamespace(request_id=r), block_ids=tables[r]) for r in ids]
        assert kept.gather(scheduled).tolist() == pad_tables([tables[r] for r in ids]).tolist()
    assert kept.table.shape[0] >= 6 and kept.table.shape[1] > 2
