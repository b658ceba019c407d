"""The scheduling flags every engine-running command takes (`add_engine_args` adds them):
`--scheduling-policy` (vLLM's flag), `--sjf-length-factor`, `--sjf-aging-s`. A bad value is one
error line naming the flag, before any model loads."""

from __future__ import annotations

import argparse
import math

from pdserve.engine.scheduling_policy import (
    DEFAULT_SCHEDULING_POLICY,
    DEFAULT_SJF_AGING_S,
    DEFAULT_SJF_LENGTH_FACTOR,
    SCHEDULING_POLICIES,
)

SCHEDULING_ARG_NAMES = ("scheduling_policy", "sjf_length_factor", "sjf_aging_s")


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    return value


def length_factor(text: str) -> float:
    value = _number(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def aging_seconds(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds (inf: no aging), got {text!r}")
    return value


def add_scheduling_args(group) -> None:
    group.add_argument("--scheduling-policy", default=DEFAULT_SCHEDULING_POLICY, choices=SCHEDULING_POLICIES,
                       help="admission order of waiting requests: fcfs (arrival), priority (a request's priority, "
                            "lower first, then arrival), sjf (shortest estimated job first, aged) "
                            "(default: %(default)s)")
    group.add_argument("--sjf-length-factor", type=length_factor, default=DEFAULT_SJF_LENGTH_FACTOR,
                       help="sjf: a job's estimated length is min(prompt tokens x this, max_tokens) "
                            "(default: %(default)s)")
    group.add_argument("--sjf-aging-s", type=aging_seconds, default=DEFAULT_SJF_AGING_S,
                       help="sjf: estimates shrink linearly to 0 over this many seconds of waiting, so a request "
                            "that has waited this long is never overtaken by a later one; inf = no aging "
                            "(default: %(default)s)")
