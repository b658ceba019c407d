"""When each request is sent: offsets in seconds from the benchmark's start.

As vLLM: the gaps between arrivals are gamma-distributed with shape = burstiness and
scale = 1 / (rate * burstiness), so the mean gap is 1 / rate whatever the burstiness, and the
gaps' squared coefficient of variation is 1 / burstiness. Burstiness 1 is exponential gaps (a
Poisson process); below 1 arrivals bunch up, above 1 they even out. Rate `inf` sends everything
at once. The first request goes at 0.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_rate(text: str) -> float:
    """'inf' or a positive number of requests per second."""
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 or 'inf', got {text!r}")
    return rate
