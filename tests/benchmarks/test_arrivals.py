"""Arrival offsets: Poisson mean gap 1/rate, burstiness scales the variance, inf sends all at once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets, parse_rate


def gaps(rate: float, burstiness: float, n: int = 20000, seed: int = 0) -> np.ndarray:
    return np.diff(arrival_offsets(n, rate, burstiness, seed))


def test_poisson_mean_gap_is_one_over_rate():
    g = gaps(4.0, 1.0)
    assert g.mean() == pytest.approx(0.25, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_burstiness_keeps_the_mean_and_scales_the_variance(burstiness):
    g = gaps(10.0, burstiness)
    assert g.mean() == pytest.approx(0.1, rel=0.05)
    # gamma(shape=b, scale=1/(rate*b)): variance 1/(rate^2 b), so CV^2 = 1/b
    assert (g.std() / g.mean()) ** 2 == pytest.approx(1 / burstiness, rel=0.1)


def test_burstier_is_more_variable():
    assert gaps(10.0, 0.5).var() > gaps(10.0, 1.0).var() > gaps(10.0, 2.0).var()


def test_offsets_start_at_zero_increase_and_repeat_with_the_seed():
    offsets = arrival_offsets(100, 5.0, 1.0, seed=3)
    assert offsets[0] == 0.0 and len(offsets) == 100
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets == arrival_offsets(100, 5.0, 1.0, seed=3)
    assert offsets != arrival_offsets(100, 5.0, 1.0, seed=4)


def test_infinite_rate_sends_everything_at_zero():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 3.0) == []


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_rates_are_refused(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)


def test_parse_rate():
    assert parse_rate("inf") == math.inf and parse_rate("2.5") == 2.5
    with pytest.raises(ValueError):
        parse_rate("0")
