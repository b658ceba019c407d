"""Where the last engine step's time went, phase by phase (always on: a few perf_counter() reads,
about a microsecond a step).

    schedule   scheduler.schedule() (and the speculative proposer, when there is one)
    prepare    the flattened batch's host tensors, their upload, and the step sent to TP workers
    forward    the model and the LM head (on CUDA the launches only: the sync lands in sample)
    sample     logits to token ids
    output     scheduler.postprocess() and the engine's per-request output work
    total      the whole step; host work = total - forward

benchmarks/host_overhead.py reports the medians of these over many steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PHASES = ("schedule", "prepare", "forward", "sample", "output")


@dataclass(slots=True)
class StepTimings:
    """Seconds per phase of the last step (each phase overwritten by the next step)."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    output: float = 0.0
    total: float = 0.0

    @property
    def host(self) -> float:
        """Everything but the forward: the engine's own cost per step."""
        return self.total - self.forward

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
