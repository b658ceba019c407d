"""free_port (utils/processes.py): ports below the kernel's ephemeral range, bindable, never handed twice."""

from __future__ import annotations

import socket

import pytest

from pdserve.utils import processes
from pdserve.utils.processes import FREE_PORTS_BELOW_EPHEMERAL, ephemeral_ports, free_port


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def kernel_port() -> int:
    """A port the kernel picks now, released again: free, and unbound until someone binds it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def scripted_picks(monkeypatch):
    """free_port's random draws taken from a list (above a range that leaves room), nothing handed out yet."""
    def script(*picks: int) -> None:
        draws = iter(picks)
        monkeypatch.setattr(processes, "ephemeral_ports", lambda: (60000, 61000))
        monkeypatch.setattr(processes._random, "randrange", lambda a, b: next(draws))
        monkeypatch.setattr(processes, "_handed", set())
    return script


def test_ports_come_from_below_the_ephemeral_range_and_bind():
    low = ephemeral_ports()[0]
    if low - max(1024, low - FREE_PORTS_BELOW_EPHEMERAL) < 1000:
        pytest.skip(f"no room below this machine's ephemeral range (starts at {low})")
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # a process never hands out one twice
    assert all(low - FREE_PORTS_BELOW_EPHEMERAL <= p < low for p in ports)
    assert all(bindable(p) for p in ports)


def test_a_bound_port_is_skipped(scripted_picks):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        free = kernel_port()
        scripted_picks(busy, busy, free)
        assert free_port() == free


def test_without_room_below_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(processes, "ephemeral_ports", lambda: (1500, 60999))  # under 1000 ports below
    monkeypatch.setattr(processes._random, "randrange", lambda a, b: pytest.fail("no pick below the range"))
    port = free_port()
    assert port >= 1024 and bindable(port)


def test_the_range_is_read_from_the_kernel_or_defaults(monkeypatch, tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE", path)
    assert ephemeral_ports() == (40000, 50000)
    monkeypatch.setattr(processes, "_EPHEMERAL_RANGE", tmp_path / "missing")
    assert ephemeral_ports() == (32768, 60999)


def test_ipv6_and_any_address():
    assert bindable(free_port("*"))
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = free_port("[::1]")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


def test_a_port_handed_out_is_not_handed_out_again(scripted_picks):
    # the first port is not bound until the process it went to starts: only the hand-out list keeps
    # the second call from drawing it again
    first, second = kernel_port(), kernel_port()
    scripted_picks(first, first, second)
    assert free_port() == first
    assert free_port() == second
