"""Whichever way `pdserve serve` ends, it stops every process and says so in one last line."""

from __future__ import annotations

import sys
import threading

import pytest

from pdserve.cli import serve

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASH = [sys.executable, "-c", "import sys; sys.exit(3)"]


def _run_stack(monkeypatch, capsys, commands, *, ready: bool, stop_after_s: float | None = None, flags=()):
    parser = serve.build_parser()
    args = parser.parse_args(["--port", str(serve.free_port()), "--ready-timeout", "20", *flags])
    monkeypatch.setattr(serve, "plan", lambda *_: commands)
    if ready:
        monkeypatch.setattr(serve, "wait_ready", lambda *_: None)
    stopping = [False]
    if stop_after_s is not None:  # what Ctrl-C does: the signal handler sets the flag
        threading.Timer(stop_after_s, lambda: stopping.__setitem__(0, True)).start()
    rc = serve.run_stack(args, parser, stopping)
    out, err = capsys.readouterr()
    return rc, out, err.splitlines()


@pytest.mark.timeout(30)
def test_a_process_dying_before_ready_stops_the_stack(monkeypatch, capsys):
    rc, out, err = _run_stack(monkeypatch, capsys, [("router", SLEEP), ("prefill-0", SLEEP), ("decode-0", CRASH)],
                              ready=False)
    assert rc == 1 and "ready" not in out
    assert err == ["pdserve serve: decode-0 exited (3) before the stack became healthy; stopping",
                   "pdserve serve: stopped (router and 2 nodes exited)"]


@pytest.mark.timeout(30)
def test_a_death_with_no_restart_stops_the_stack(monkeypatch, capsys):
    rc, out, err = _run_stack(monkeypatch, capsys, [("router", SLEEP), ("both-0", CRASH)], ready=True,
                              flags=["--no-restart"])
    assert rc == 1 and "pdserve is ready" in out
    assert err == ["pdserve serve: both-0 exited (3); stopping the stack",
                   "pdserve serve: stopped (router and 1 node exited)"]


@pytest.mark.timeout(30)
def test_a_crash_loop_stops_the_stack(monkeypatch, capsys):
    monkeypatch.setattr(serve, "MAX_RESTARTS", 2)
    rc, _, err = _run_stack(monkeypatch, capsys, [("router", CRASH), ("prefill-0", SLEEP), ("decode-0", SLEEP)],
                            ready=True)
    assert rc == 1
    assert err == ["pdserve serve: router exited (3); restarting it"] * 2 + [
        f"pdserve serve: router exited (3) 3 times within {serve.RESTART_WINDOW_S:g} s; stopping the stack",
        "pdserve serve: stopped (router and 2 nodes exited)"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("ready", [False, True], ids=["while-starting", "while-serving"])
def test_ctrl_c_stops_the_stack(monkeypatch, capsys, ready):
    rc, _, err = _run_stack(monkeypatch, capsys, [("router", SLEEP), ("prefill-0", SLEEP), ("decode-0", SLEEP)],
                            ready=ready, stop_after_s=1.0)
    assert rc == 0
    assert err == ["pdserve serve: stopped (router and 2 nodes exited)"]
