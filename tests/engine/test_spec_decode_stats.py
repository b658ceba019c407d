"""Sampling with speculation keeps the target's distribution (temperature > 0).

On a tiny model with a 16-token vocabulary whose next-token distributions are peaked (the top
token 0.4-0.75), the draft is the target itself run greedily: it proposes each position's most
likely token, so proposals are accepted about half the time, the case where a wrong rule shows
most. NUM_SAMPLES requests sample MAX_TOKENS tokens each, with and without speculation
(independent streams); at each output position the two token histograms are compared with
Pearson's chi-square test of homogeneity (bins with fewer than 10 samples in all pooled).

Threshold: the run fails when any position's p-value is below ALPHA / MAX_TOKENS (Bonferroni), so
a correct sampler fails this test with probability at most ALPHA = 1e-3 (and never in practice:
the engine's unseeded draws come from fixed generator seeds, so the test is deterministic).
Power: the classic bug of drawing from p instead of the residual after a rejection makes the top
token's probability p + (1 - p) p instead of p (0.63 instead of 0.39 at position 0); with 2,000
samples per side that is a chi-square in the hundreds. The second test runs that wrong rule and
asserts that this same check rejects it.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams

NUM_SAMPLES = 2000
MAX_TOKENS = 4
ALPHA = 1e-3
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    from tests.conftest import save_tiny_model

    path = tmp_path_factory.mktemp("tiny-vocab16")
    save_tiny_model(path, "llama", vocab_size=16, bos_token_id=13, eos_token_id=14, pad_token_id=15,
                    initializer_range=0.2)
    return path


def sample(model, seed: int, spec: dict | None) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(model), dtype="float32", num_threads=2, block_size=4, num_kv_blocks=NUM_SAMPLES * 3,
              max_num_seqs=NUM_SAMPLES, max_num_batched_tokens=8192, seed=seed, speculative_config=spec)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, ignore_eos=True)
    outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
    return [o.token_ids for o in outs], llm


def position_p_values(a: list[list[int]], b: list[list[int]]) -> list[float]:
    """Chi-square homogeneity p-value of the token histograms of a and b at each output position."""
    p_values = []
    for pos in range(MAX_TOKENS):
        counts = torch.zeros(2, 16, dtype=torch.long)
        for row, outs in enumerate((a, b)):
            counts[row] += torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=16)
        big = counts.sum(0) >= 10
        table = torch.cat([counts[:, big], counts[:, ~big].sum(1, keepdim=True)], 1)
        table = table[:, table.sum(0) > 0]
        p_values.append(chi_square_homogeneity(table.double()))
    return p_values


def chi_square_homogeneity(table: torch.Tensor) -> float:
    """Pearson's test that the rows of a contingency table [2, bins] come from one distribution:
    the p-value, P(chi2 with (bins - 1) degrees of freedom >= statistic) = Q(df / 2, stat / 2)."""
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def plain_samples(peaked_model):
    return sample(peaked_model, 1, None)[0]


@pytest.mark.slow
def test_speculative_sampling_keeps_the_target_distribution(peaked_model, plain_samples):
    spec, llm = sample(peaked_model, 2, {"model": str(peaked_model), "num_speculative_tokens": 3})
    stats = llm.engine.spec_stats
    assert 0.2 < stats.acceptance_rate < 0.8, stats.to_dict()  # both branches exercised, many times
    p_values = position_p_values(plain_samples, spec)
    print("p-values per position", p_values)
    assert min(p_values) > ALPHA / MAX_TOKENS, p_values


def wrong_verify(sampler, logits, items):
    """A classic bug: accept draft d with probability p(d), but after a rejection draw from p
    itself instead of the residual (p without d)."""
    gen = torch.Generator().manual_seed(7)
    probs = torch.softmax(logits.float(), -1)
    out, row = {}, 0
    for item in items:
        emitted = []
        for j in range(len(item.spec_token_ids) + 1):
            p = probs[row + j]
            draft = item.spec_token_ids[j] if j < len(item.spec_token_ids) else None
            if draft is not None and torch.rand((), generator=gen) < p[draft]:
                emitted.append((draft, None))
                continue
            emitted.append((int(torch.multinomial(p, 1, generator=gen)), None))
            break
        row += len(item.spec_token_ids) + 1
        out[item.request.request_id] = emitted if item.spec_token_ids else emitted[0]
    return out


@pytest.mark.slow
def test_the_check_rejects_a_wrong_acceptance_rule(peaked_model, plain_samples, monkeypatch):
    import pdserve.engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "verify_drafts", wrong_verify)
    spec, _ = sample(peaked_model, 2, {"model": str(peaked_model), "num_speculative_tokens": 3})
    p_values = position_p_values(plain_samples, spec)
    print("p-values per position, wrong rule", p_values)
    assert min(p_values) < ALPHA / MAX_TOKENS, p_values
