"""Sampler: seeded reproducibility, greedy, the distribution of draws, each filter and penalty
against hand-computed values, raw logprobs, and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.sampler import (
    Sampler,
    SamplingInput,
    apply_penalties,
    apply_top_k_top_p_min_p,
    argmax_rows,
    draw,
    seeded_uniform,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels import cpu_native

VOCAB = 50


def make_row(prompt=(1, 2, 3), output=(), **params) -> SamplingInput:
    return SamplingInput(SamplingParams(**params), list(prompt), output)


def random_logits(num_rows: int = 1, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def logits_of(probs) -> torch.Tensor:
    return torch.as_tensor(probs, dtype=torch.float32).log()[None, :]


def frequencies(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).double() / len(token_ids)


def chi_square(token_ids: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(token_ids), minlength=probs.numel()).double()
    expected = probs.double() * len(token_ids)
    support = expected > 0
    assert observed[~support].sum() == 0, "drew a token of probability 0"
    return float(((observed[support] - expected[support]) ** 2 / expected[support]).sum())


def sample_many(logits_row: torch.Tensor, num: int, seed: int | None = None, **params) -> list[int]:
    """`num` draws of one distribution: seeded rows use positions 0..num-1, unseeded ones the generator."""
    shared = SamplingParams(seed=seed, **params)
    rows = [SamplingInput(shared, [], range(i)) for i in range(num)]
    return Sampler(seed=3)(logits_row.expand(num, -1), rows).token_ids


# ---- seeded draws -----------------------------------------------------------------------


def test_seeded_uniform_is_a_fixed_function_of_seed_and_position():
    # nodes in other processes (and future versions) must agree, so the values are pinned
    assert seeded_uniform(1234, 0) == 0.6175520046213671
    assert seeded_uniform(1234, 7) == 0.6981341974772763
    assert seeded_uniform(-1, 3) == 0.011382352467864343
    assert 0 <= seeded_uniform(2**70, 2**40) < 1


def test_same_seed_and_position_give_the_same_token_whatever_the_batch():
    vocab = 700  # more than one CDF block
    target = random_logits(1, vocab, seed=1, scale=0.5)
    others = random_logits(5, vocab, seed=2)
    for position in range(30):
        row = make_row(output=[7] * position, seed=42, temperature=0.9, top_p=0.95)
        alone = Sampler(seed=0)(target, [row]).token_ids[0]
        batch = [make_row(temperature=0), make_row(), row, make_row(seed=5, output=[1]), make_row(top_k=3)]
        logits = torch.cat([others[:2], target, others[2:4]])
        mixed = Sampler(seed=99)(logits, batch).token_ids[2]
        reordered = Sampler(seed=7)(torch.cat([target, others[:1]]), [row, make_row()]).token_ids[0]
        assert alone == mixed == reordered, position


def test_seeded_draws_differ_across_positions_and_follow_the_distribution():
    probs = torch.full((10,), 0.1)
    token_ids = sample_many(logits_of(probs), 5000, seed=11)
    assert chi_square(token_ids, probs) < 30  # df = 9; 30 is far in the tail
    other_seed = sample_many(logits_of(probs), 200, seed=12)
    assert sum(a != b for a, b in zip(token_ids[:200], other_seed, strict=True)) > 150


def test_unseeded_rows_follow_the_sampler_seed():
    logits = random_logits(64, scale=0.3)
    rows = [make_row() for _ in range(64)]
    first, again = Sampler(seed=1)(logits, rows).token_ids, Sampler(seed=1)(logits, rows).token_ids
    assert first == again
    assert first != Sampler(seed=2)(logits, rows).token_ids


# ---- greedy and temperature -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_rows_take_the_argmax(dtype):
    logits = random_logits(8).to(dtype)
    out = Sampler()(logits, [make_row(temperature=0) for _ in range(8)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize("native", ["1", "0"])
def test_argmax_rows_matches_torch_on_ties_nan_inf_and_strided_rows(native, monkeypatch):
    # On the CPU the compiled op (float32 or bf16 contiguous rows) or numpy's argmax (the rest, or
    # no compiled ops: torch's last-dim argmax is slow there) must pick what torch's picks: the
    # first maximum on ties, a NaN where a row has one, any index of an all -inf row the same one.
    monkeypatch.setenv(cpu_native.NATIVE_ENV, native)
    g = torch.Generator().manual_seed(0)
    logits = torch.randint(-3, 3, (64, 40), generator=g).float()  # many ties
    logits[3, 5] = logits[3, 30] = float("nan")
    logits[4] = float("-inf")
    logits[5, 7] = float("inf")
    logits[6, :] = 2.0
    for case in (logits, logits[:, ::3], logits.t().contiguous().t(), logits.double(), logits[:0]):
        got = argmax_rows(case)
        assert got.dtype == torch.int64 and got.tolist() == case.argmax(-1).tolist()
    half = logits.to(torch.bfloat16)
    assert argmax_rows(half).tolist() == half.argmax(-1).tolist()
    assert argmax_rows(half[:, 1::2]).tolist() == half[:, 1::2].argmax(-1).tolist()


def test_greedy_rows_inside_a_mixed_batch_take_the_argmax():
    logits = random_logits(6)
    rows = [
        make_row(temperature=0),
        make_row(top_k=2),
        make_row(temperature=0, seed=3),
        make_row(),
        make_row(temperature=0, top_p=0.1),
        make_row(min_p=0.5),
    ]
    token_ids = Sampler()(logits, rows).token_ids
    expected = logits.argmax(-1).tolist()
    assert [token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    logits = random_logits(1, vocab=10, seed=4, scale=1.0)
    token_ids = sample_many(logits, 20000, temperature=temperature)
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    assert chi_square(token_ids, probs) < 35  # df = 9
    assert (frequencies(token_ids, 10) - probs).abs().max() < 0.015


def test_sampler_leaves_the_callers_logits_alone():
    logits = random_logits(3)
    before = logits.clone()
    rows = [
        make_row(temperature=0.5, top_k=3),
        make_row(repetition_penalty=1.5, presence_penalty=1.0),
        make_row(temperature=0, frequency_penalty=1.0, output=[4]),
    ]
    Sampler()(logits, rows)
    Sampler()(logits, [make_row(temperature=0.5, top_p=0.5, min_p=0.1)] * 3)  # no copy for penalties here
    assert torch.equal(logits, before)


# ---- the draw itself ----------------------------------------------------------------------


def test_draw_is_an_exact_inverse_cdf_across_blocks():
    weights = torch.zeros(1, 600)  # three CDF blocks, the last one padded
    picks = {3: 0.1, 255: 0.2, 256: 0.3, 511: 0.15, 599: 0.25}
    for token_id, weight in picks.items():
        weights[0, token_id] = weight * 7  # unnormalised on purpose
    num = 2000
    uniforms = (torch.arange(num, dtype=torch.float64) + 0.5) / num  # a regular grid: counts are exact
    token_ids = draw(weights.expand(num, -1), uniforms).tolist()
    for token_id, weight in picks.items():
        assert abs(token_ids.count(token_id) - weight * num) <= 1
    assert set(token_ids) == set(picks)


def test_draw_never_picks_a_zero_weight_token_at_the_edges():
    weights = torch.tensor([[0.0, 0.0, 1.0, 2.0, 0.0, 0.0]])
    edges = torch.tensor([0.0, 1 / 3, 1 - 2**-53], dtype=torch.float64)
    assert draw(weights.expand(3, -1), edges).tolist() == [2, 3, 3]


# ---- filters --------------------------------------------------------------------------------


def finite_ids(masked: torch.Tensor) -> set[int]:
    return set(torch.isfinite(masked[0]).nonzero().flatten().tolist())


def test_top_k_keeps_exactly_the_k_largest():
    logits = random_logits(3)
    masked = apply_top_k_top_p_min_p(logits.clone(), [5, -1, 1], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    assert finite_ids(masked[0:1]) == set(logits[0].topk(5).indices.tolist())
    assert torch.equal(masked[1], logits[1])
    assert finite_ids(masked[2:3]) == {int(logits[2].argmax())}
    assert torch.equal(masked[0][torch.isfinite(masked[0])], logits[0][torch.isfinite(masked[0])])


def test_top_k_draws_stay_inside_the_top_k():
    logits = random_logits(1, scale=0.5)
    token_ids = sample_many(logits, 3000, top_k=4)
    assert set(token_ids) == set(logits[0].topk(4).indices.tolist())


# probabilities spread over shuffled token ids; the nucleus is read off the sorted values
NUCLEUS_PROBS = [0.05, 0.25, 0.1, 0.4, 0.05, 0.15]  # sorted: .4 .25 .15 .1 .05 .05


@pytest.mark.parametrize(
    "top_p, nucleus",
    [(0.3, {3}), (0.6, {3, 1}), (0.7, {3, 1, 5}), (0.85, {3, 1, 5, 2}), (0.99, {0, 1, 2, 3, 4, 5})],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, nucleus):
    masked = apply_top_k_top_p_min_p(logits_of(NUCLEUS_PROBS), -1, top_p, 0.0)
    assert finite_ids(masked) == nucleus


def test_top_p_draws_stay_inside_the_nucleus_and_renormalise():
    token_ids = sample_many(logits_of(NUCLEUS_PROBS), 6000, seed=5, top_p=0.7)
    expected = torch.tensor([0, 0.25, 0, 0.4, 0, 0.15]) / 0.8
    assert set(token_ids) == {1, 3, 5}
    assert chi_square(token_ids, expected) < 20  # df = 2


def reference_nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    order = logits.argsort(descending=True)
    probs = torch.softmax(logits[order].double(), dim=-1)
    num_keep = int(((probs.cumsum(-1) - probs) < top_p).sum())
    return set(order[:num_keep].tolist())


@pytest.mark.parametrize("vocab, scale, top_p", [(50, 2.0, 0.9), (3000, 0.05, 0.9), (40000, 0.5, 0.9)])
def test_top_p_matches_a_full_sort_beyond_the_first_candidates(vocab, scale, top_p):
    logits = random_logits(1, vocab, seed=6, scale=scale)
    if vocab == 40000:
        logits[0, :3000] += 6.0  # a nucleus of a few thousand: past the first candidates, short of a sort
    masked = apply_top_k_top_p_min_p(logits.clone(), [-1], [top_p], [0.0])
    assert finite_ids(masked) == reference_nucleus(logits[0], top_p)


def test_min_p_drops_tokens_below_min_p_times_the_top_probability():
    probs = [0.09, 0.5, 0.1, 0.2, 0.06, 0.05]
    masked = apply_top_k_top_p_min_p(logits_of(probs), -1, 1.0, 0.19)  # threshold 0.095
    assert finite_ids(masked) == {1, 2, 3}
    assert finite_ids(apply_top_k_top_p_min_p(logits_of(probs), -1, 1.0, 1.0)) == {1}
    token_ids = sample_many(logits_of(probs), 2000, min_p=0.19)
    assert set(token_ids) == {1, 2, 3}


def test_top_p_renormalises_over_what_min_p_and_top_k_kept():
    # vLLM order: min_p and top_k first, then top_p over the renormalised survivors
    probs = [0.5, 0.2, 0.1, 0.1, 0.1]
    assert finite_ids(apply_top_k_top_p_min_p(logits_of(probs), -1, 0.65, 0.3)) == {0}  # [.714, .286]
    assert finite_ids(apply_top_k_top_p_min_p(logits_of(probs), -1, 0.65, 0.0)) == {0, 1}
    probs = [0.4, 0.3, 0.2, 0.1]
    assert finite_ids(apply_top_k_top_p_min_p(logits_of(probs), 2, 0.55, 0.0)) == {0}  # [.571, .429]
    assert finite_ids(apply_top_k_top_p_min_p(logits_of(probs), -1, 0.55, 0.0)) == {0, 1}


def test_filters_apply_per_row_and_accept_tensors():
    logits = torch.cat([logits_of(NUCLEUS_PROBS)] * 3)
    masked = apply_top_k_top_p_min_p(
        logits, torch.tensor([2, 0, -1]), torch.tensor([1.0, 0.3, 1.0]), torch.tensor([0.0, 0.0, 0.5])
    )
    assert [finite_ids(masked[i : i + 1]) for i in range(3)] == [{3, 1}, {3}, {3, 1}]


# ---- penalties ------------------------------------------------------------------------------

BASE = [2.0, -1.0, 0.5, 3.0, -0.5, 1.0, 0.0]


def penalized(**params) -> list[float]:
    row = make_row(prompt=[0, 1], output=[2, 2, 5, 2], **params)
    return apply_penalties(torch.tensor([BASE]), [row])[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # prompt {0, 1} and output {2, 5} are seen; 3, 4, 6 are not
    assert penalized(repetition_penalty=2.0) == pytest.approx([1.0, -2.0, 0.25, 3.0, -0.5, 0.5, 0.0])
    assert penalized(repetition_penalty=0.5) == pytest.approx([4.0, -0.5, 1.0, 3.0, -0.5, 2.0, 0.0])


def test_frequency_penalty_subtracts_per_occurrence_in_the_output():
    # output counts: token 2 three times, token 5 once; prompt tokens are not counted
    assert penalized(frequency_penalty=0.5) == pytest.approx([2.0, -1.0, -1.0, 3.0, -0.5, 0.5, 0.0])


def test_presence_penalty_subtracts_once_per_output_token():
    assert penalized(presence_penalty=0.3) == pytest.approx([2.0, -1.0, 0.2, 3.0, -0.5, 0.7, 0.0])


def test_penalties_combine_repetition_first():
    expected = [1.0, -2.0, 0.25 - 3 * 0.5 - 0.3, 3.0, -0.5, 0.5 - 0.5 - 0.3, 0.0]
    assert penalized(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3) == pytest.approx(
        expected
    )


def test_penalties_apply_per_row():
    logits = torch.tensor([BASE, BASE, BASE])
    rows = [
        make_row(prompt=[0], output=[3], presence_penalty=1.0),
        make_row(prompt=[0], output=[3]),
        make_row(prompt=[3], output=[0, 0], frequency_penalty=-1.0),
    ]
    out = apply_penalties(logits, rows)
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 0.5, 2.0, -0.5, 1.0, 0.0])
    assert out[1].tolist() == BASE
    assert out[2].tolist() == pytest.approx([4.0, -1.0, 0.5, 3.0, -0.5, 1.0, 0.0])


def test_greedy_with_a_penalty_takes_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([BASE])
    assert Sampler()(logits, [make_row(temperature=0)]).token_ids == [3]
    assert Sampler()(logits, [make_row(output=[3], temperature=0, presence_penalty=1.5)]).token_ids == [0]


def test_penalising_a_token_outside_the_vocab_raises():
    with pytest.raises(ValueError, match="token ids"):
        apply_penalties(torch.zeros(1, 4), [make_row(output=[4], presence_penalty=1.0)])


# ---- logprobs -------------------------------------------------------------------------------


def test_logprobs_hold_top_n_and_the_sampled_token_of_the_raw_distribution():
    logits = random_logits(2)
    rows = [
        make_row(output=[0, 1], logprobs=3, temperature=0.3, top_k=2, repetition_penalty=1.7, seed=1),
        make_row(logprobs=3, top_k=1, seed=2),
    ]
    raw = torch.log_softmax(logits, dim=-1)  # temperature, top_k and penalties must not show
    out = Sampler()(logits, rows)
    for i, entry in enumerate(out.logprobs):
        top = set(raw[i].topk(3).indices.tolist())
        assert set(entry) == top | {out.token_ids[i]}
        for token_id, value in entry.items():
            assert value == pytest.approx(float(raw[i, token_id]), abs=1e-5)


def test_logprobs_include_a_sampled_token_outside_the_top_n():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    row = make_row(prompt=[], output=[0, 1], repetition_penalty=100.0, temperature=0, logprobs=1)
    out = Sampler()(logits, [row])
    assert out.token_ids == [2]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0] == pytest.approx({0: float(raw[0]), 2: float(raw[2])})


def test_logprobs_zero_gives_only_the_sampled_token():
    logits = random_logits(2)
    out = Sampler()(logits, [make_row(logprobs=0), make_row()])
    assert list(out.logprobs[0]) == [out.token_ids[0]]
    assert out.logprobs[0][out.token_ids[0]] == pytest.approx(
        float(torch.log_softmax(logits[0], -1)[out.token_ids[0]])
    )
    assert out.logprobs[1] is None


# ---- shapes ---------------------------------------------------------------------------------


def test_a_row_count_mismatch_raises_and_an_empty_batch_is_fine():
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(2, VOCAB), [make_row()])
    assert Sampler()(torch.zeros(0, VOCAB), []).token_ids == []


# ---- SamplingParams validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", 1.5),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("seed", 1.5),
        ("seed", "7"),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("ignore_eos", 1),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", True),
    ],
)
def test_invalid_sampling_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} "):
        SamplingParams(**{field: value})


def test_sampling_params_normalise_and_round_trip():
    params = SamplingParams(top_k=0, stop="###", temperature=0, seed=3, logprobs=2)
    assert params.top_k == -1 and params.stop == ["###"] and params.greedy
    assert SamplingParams.from_dict(params.to_dict()) == params
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_dict({"temprature": 1.0})


@pytest.mark.parametrize("penalty", [1e-40, 1e39])
@pytest.mark.parametrize("temperature", [0.0, 0.7, 1e-4])
def test_extreme_repetition_penalty_still_samples(penalty, temperature):
    """Penalties that overflow float32 logits (inf, NaN) must not break the batch (found by fuzzing)."""
    logits = random_logits(2, scale=30.0)
    rows = [make_row(prompt=range(20), repetition_penalty=penalty, temperature=temperature, seed=1),
            make_row(temperature=0.5, seed=2)]
    out = Sampler()(logits, rows)
    assert all(0 <= t < VOCAB for t in out.token_ids)
