"""The errors a tensor-parallel node raises about its worker ranks (no torch import: the CLI
catches them to print one line)."""

from __future__ import annotations


class TPWorkerError(RuntimeError):
    """A worker rank died (or the ranks fell out of step): the node can no longer run a step and
    fails as a whole. `rank` is None when no worker exited (a collective failed or timed out)."""

    def __init__(self, message: str, rank: int | None = None, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exit_code = exit_code


class TPStartupError(TPWorkerError):
    """A worker rank never came up: it exited during start-up, or missed a start-up deadline."""
