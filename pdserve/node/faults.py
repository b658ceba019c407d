"""The one fault-injection hook of a node, for tests and chaos runs (never set in production).

    step_delay_s     a slower device: the node sleeps this long before each engine step
    kv_pull_delay_s  decode: a slower network: a request's KV pull starts no sooner than this
                     long after its KVReady arrived
    kv_fault         prefill: "drop:N" answers every Nth KV pull served over ZMQ with nothing
                     (the decode node times out), "corrupt:N" sends that payload one byte short
                     (the decode node rejects it); KVSender calls `spoil_payload` per pull

The hidden flags `--step-delay-s`, `--kv-pull-delay-s` and `--inject-kv-fault` build one
`FaultInjection` (`from_args`); a node without any of them gets None.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

KV_FAULT_KINDS = ("drop", "corrupt")


def parse_kv_fault(spec: str) -> tuple[str, int]:
    """`"drop:3"` → ("drop", 3); ValueError for anything else."""
    kind, _, every = spec.partition(":")
    if kind not in KV_FAULT_KINDS or not every.isdigit() or int(every) < 1:
        raise ValueError(f"bad fault spec {spec!r}: expected drop:N or corrupt:N")
    return kind, int(every)


@dataclass
class FaultInjection:
    step_delay_s: float = 0.0
    kv_pull_delay_s: float = 0.0
    kv_fault: str | None = None  # "drop:N" | "corrupt:N"
    num_payloads: int = field(default=0, init=False)  # spoil_payload calls so far

    def __post_init__(self) -> None:
        for name in ("step_delay_s", "kv_pull_delay_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self._kv_fault = parse_kv_fault(self.kv_fault) if self.kv_fault else None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultInjection | None:
        """From the hidden flags (each role parser has its own subset); None when none is set."""
        faults = cls(step_delay_s=getattr(args, "step_delay_s", 0.0) or 0.0,
                     kv_pull_delay_s=getattr(args, "kv_pull_delay_s", 0.0) or 0.0,
                     kv_fault=getattr(args, "inject_kv_fault", None))
        return faults if faults.is_active else None

    @property
    def is_active(self) -> bool:
        return bool(self.step_delay_s or self.kv_pull_delay_s or self._kv_fault)

    def delay_step(self) -> None:
        """Called before each engine step."""
        if self.step_delay_s:
            time.sleep(self.step_delay_s)

    def pull_arrived_before(self, now: float) -> float | None:
        """The latest KVReady arrival (monotonic) whose pull may start at `now`; None: any."""
        return now - self.kv_pull_delay_s if self.kv_pull_delay_s else None

    def spoil_payload(self, frame: memoryview) -> memoryview | None:
        """Called once per KV payload about to be served: every Nth is dropped (None) or cut one
        byte short; the others pass unchanged."""
        self.num_payloads += 1
        if self._kv_fault is None or self.num_payloads % self._kv_fault[1]:
            return frame
        kind = self._kv_fault[0]
        logger.warning("injected fault: %s KV payload #%d (%s)", kind, self.num_payloads, self.kv_fault)
        if kind == "drop":
            return None
        return memoryview(frame).cast("B")[:-1]
