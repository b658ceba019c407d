"""The fault-injection hook: spec parsing, every Nth payload dropped or cut short, the hidden flags."""

from __future__ import annotations

import argparse
import logging

import pytest

from pdserve.node.faults import FaultInjection, parse_kv_fault


def test_parse_kv_fault():
    assert parse_kv_fault("drop:3") == ("drop", 3)
    assert parse_kv_fault("corrupt:1") == ("corrupt", 1)
    for bad in ("drop", "drop:0", "drop:-1", "explode:2", "corrupt:x", ""):
        with pytest.raises(ValueError, match="bad fault spec"):
            parse_kv_fault(bad)
    with pytest.raises(ValueError, match="bad fault spec"):
        FaultInjection(kv_fault="drop:zero")
    with pytest.raises(ValueError, match="step_delay_s"):
        FaultInjection(step_delay_s=-1)


def test_every_nth_payload_is_dropped(caplog):
    faults = FaultInjection(kv_fault="drop:2")
    frame = memoryview(b"0123456789")
    with caplog.at_level(logging.WARNING, logger="pdserve.node.faults"):
        got = [faults.spoil_payload(frame) for _ in range(4)]
    assert got[0] is frame and got[1] is None and got[2] is frame and got[3] is None
    assert "injected fault: drop" in caplog.text and faults.num_payloads == 4


def test_every_nth_payload_is_cut_one_byte_short(caplog):
    faults = FaultInjection(kv_fault="corrupt:3")
    frame = memoryview(bytearray(range(10)))
    with caplog.at_level(logging.WARNING, logger="pdserve.node.faults"):
        got = [faults.spoil_payload(frame) for _ in range(3)]
    assert got[0] is frame and got[1] is frame
    assert bytes(got[2]) == bytes(range(9))
    assert "injected fault: corrupt" in caplog.text


def test_no_kv_fault_passes_every_payload():
    faults = FaultInjection(step_delay_s=0.5)
    frame = memoryview(b"abc")
    assert all(faults.spoil_payload(frame) is frame for _ in range(5))


def test_from_args_builds_one_hook_or_none():
    ns = argparse.Namespace
    assert FaultInjection.from_args(ns(step_delay_s=0.0)) is None  # a flag-free node has no hook
    assert FaultInjection.from_args(ns(step_delay_s=0.0, kv_pull_delay_s=0.0, inject_kv_fault=None)) is None
    faults = FaultInjection.from_args(ns(step_delay_s=0.05, kv_pull_delay_s=1.5))
    assert (faults.step_delay_s, faults.kv_pull_delay_s, faults.kv_fault) == (0.05, 1.5, None)
    assert FaultInjection.from_args(ns(step_delay_s=0.0, inject_kv_fault="drop:2")).kv_fault == "drop:2"
    with pytest.raises(ValueError):
        FaultInjection.from_args(ns(inject_kv_fault="drop:"))


def test_pull_delay():
    assert FaultInjection().pull_arrived_before(100.0) is None
    assert FaultInjection(kv_pull_delay_s=1.5).pull_arrived_before(100.0) == 98.5


def test_hidden_flags_still_parse():
    from pdserve.decode_node.__main__ import build_parser as decode_parser
    from pdserve.prefill_node.__main__ import build_parser as prefill_parser

    args = prefill_parser().parse_args(["--router", "tcp://x:1", "--inject-kv-fault", "corrupt:2",
                                        "--step-delay-s", "0.4"])
    faults = FaultInjection.from_args(args)
    assert (faults.kv_fault, faults.step_delay_s) == ("corrupt:2", 0.4)
    args = decode_parser().parse_args(["--router", "tcp://x:1", "--kv-pull-delay-s", "1.5"])
    assert FaultInjection.from_args(args).kv_pull_delay_s == 1.5 and args.role == "decode"
    assert "--inject-kv-fault" not in prefill_parser().format_help()
