"""Each node's speed, fitted online from the engine steps its heartbeats report: no profiling run.

A node sends, with every heartbeat, the engine steps it ran since the last one
(`Heartbeat.step_samples`): prefill tokens scheduled, decode sequences, the context tokens of
those sequences, and the step's wall seconds. `StepModel` fits

    seconds = c0 + c1 * prefill_tokens + c2 * decode_seqs + c3 * context_tokens

by least squares over the last WINDOW steps with prefill and the last WINDOW decode-only steps,
kept apart so that a run of one kind never flushes the other (a small ridge term keeps the fit
defined while the steps seen are all of one kind, with the prior as its centre). Every coefficient is kept >= 0:
a step never gets faster with more work. Until a node has reported MIN_SAMPLES steps with
prefill and MIN_SAMPLES that decoded (alone or beside a chunk), `known` is False and the policies that read it (router/disagg.py, router/planner.py)
treat its speed as unknown.

The registry keeps one per node and one for the fleet (every node's steps pooled): a prefill
node's steps show only prefill and a decode node's only decode, so until a node has done both,
the policies read the fleet's fit (the nodes serve the same model, usually on the same hardware).

The same class serves the fleet simulator (benchmarks/fleet_sim.py), which feeds it the
simulated nodes' steps exactly as heartbeats would.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence

import numpy as np

WINDOW = 512  # steps the fit remembers (the newest)
MIN_SAMPLES = 8  # steps with prefill, and steps of decode only, before the fit is trusted
RIDGE = 1e-5  # pulls each coefficient towards the prior, relative to the features' scale
# A prior for a node not yet measured: a small model on a CPU (2 ms a step, 0.1 ms a prefill token,
# 0.2 ms a sequence, 20 ns a context token). Only its order of magnitude matters: `known` gates it.
PRIOR = (2e-3, 1e-4, 2e-4, 2e-8)
DEFAULT_CHUNK = 256  # prefill tokens a step takes, until a node's steps show its budget
REFIT_EVERY = 16  # new steps before the fit is redone


class StepModel:
    def __init__(self, prior: Sequence[float] = PRIOR, window: int = WINDOW) -> None:
        self.prior = np.asarray(prior, dtype=np.float64)
        self.coef = self.prior.copy()
        # Two windows, so that one kind of step never pushes the other out (a fleet's pooled
        # samples come in runs of one node's kind): steps with prefill, and decode-only steps.
        self._prefill_steps: collections.deque[tuple[float, float, float, float]] = collections.deque(maxlen=window)
        self._decode_steps: collections.deque[tuple[float, float, float, float]] = collections.deque(maxlen=window)
        self._num_mixed = 0  # steps in the prefill window that also decoded: decode evidence too
        self._new = 0  # samples since the last fit
        self._fitted = False
        self.last_decode: tuple[float, float] | None = None  # (sequences, context tokens) of the newest decode step
        self.max_chunk = 0  # the most prefill tokens one step took: the node's chunk budget, as seen

    # ---- feeding --------------------------------------------------------------------------
    def add(self, samples: Iterable[Sequence[float]]) -> None:
        for s in samples:
            prefill, seqs, ctx, secs = (float(x) for x in s)
            if not all(math.isfinite(v) and v >= 0 for v in (prefill, seqs, ctx, secs)) or secs <= 0:
                continue  # a garbled sample says nothing
            row = (prefill, seqs, ctx, secs)
            if prefill > 0:
                window = self._prefill_steps
                if len(window) == window.maxlen and window[0][1] > 0:
                    self._num_mixed -= 1
                window.append(row)
                self._num_mixed += seqs > 0
            elif seqs > 0:
                self._decode_steps.append(row)
            else:
                continue  # an empty step
            if seqs > 0:
                self.last_decode = (seqs, ctx)
            self.max_chunk = max(self.max_chunk, int(prefill))
            self._new += 1

    @property
    def num_samples(self) -> int:
        return len(self._prefill_steps) + len(self._decode_steps)

    @property
    def known(self) -> bool:
        """Enough steps with prefill, and enough that decoded (alone, or beside a prefill chunk,
        as a colocated node's steps do), to trust the fit."""
        return (len(self._prefill_steps) >= MIN_SAMPLES
                and len(self._decode_steps) + self._num_mixed >= MIN_SAMPLES)

    # ---- the fit --------------------------------------------------------------------------
    def coefficients(self) -> np.ndarray:
        """The fit, redone once REFIT_EVERY new steps arrived (a fleet's router reads it for every
        request; the coefficients move slowly)."""
        if self._new >= REFIT_EVERY or (self._new and not self._fitted):
            self._fit()
        return self.coef

    def _fit(self) -> None:
        self._new = 0
        if self.num_samples < 4:
            return
        self._fitted = True
        data = np.asarray([*self._prefill_steps, *self._decode_steps], dtype=np.float64)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1], data[:, 2]])
        y = data[:, 3]
        # Scale columns so the ridge weighs each feature alike; centre the ridge on the prior.
        scale = np.maximum(np.abs(x).max(axis=0), 1e-9)
        xs = x / scale
        prior_s = self.prior * scale
        lam = RIDGE * len(data)
        a = xs.T @ xs + lam * np.eye(4)
        b = xs.T @ y + lam * prior_s
        try:
            coef = np.linalg.solve(a, b) / scale
        except np.linalg.LinAlgError:
            return
        self.coef = np.maximum(coef, 0.0)

    # ---- predictions ----------------------------------------------------------------------
    def step_s(self, prefill_tokens: float = 0.0, decode_seqs: float = 0.0, context_tokens: float = 0.0) -> float:
        c = self.coefficients()
        return float(c[0] + c[1] * prefill_tokens + c[2] * decode_seqs + c[3] * context_tokens)

    @property
    def chunk(self) -> int:
        """Prefill tokens a step takes at most (DEFAULT_CHUNK until a step showed more)."""
        return max(self.max_chunk, DEFAULT_CHUNK)

    def prefill_s(self, tokens: float, *, chunk: int | None = None, decode_seqs: float = 0.0, context_tokens: float = 0.0) -> float:
        """Seconds to prefill `tokens` in chunks of `chunk`, beside a decode batch of `decode_seqs`
        sequences holding `context_tokens` (a colocated or local prefill shares its steps)."""
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / max(1, chunk or self.chunk))
        c = self.coefficients()
        per_step = c[0] + c[2] * decode_seqs + c[3] * context_tokens
        return float(steps * per_step + c[1] * tokens)

    def decode_step_s(self, seqs: float, context_tokens: float) -> float:
        return self.step_s(0.0, seqs, context_tokens)

    def summary(self) -> dict:
        c = self.coefficients()
        return {"known": self.known, "samples": self.num_samples, "step_s": round(float(c[0]), 6),
                "prefill_token_s": float(c[1]), "decode_seq_s": float(c[2]), "context_token_s": float(c[3])}
