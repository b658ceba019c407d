"""Local child processes, as the commands that supervise some (`pdserve serve`, `pdserve router
--api-server-count`) start and stop them: a free port to give one, and stopping a set of them."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
from pathlib import Path

# Ports free_port picks from, below the kernel's ephemeral range (see free_port).
FREE_PORTS_BELOW_EPHEMERAL = 12000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_random = random.SystemRandom()  # not the global generator, which a test or a process may seed
_handed: set[int] = set()  # ports this process handed out: not handed again before they are bound


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (and of binds to port 0)."""
    try:
        low, high = (int(v) for v in _EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (an IPv6 address, bracketed or not, or "*" for any).

    The caller hands the port to a process that binds it later (a router's control socket, a
    node's status port); until then nothing holds it. A port the kernel picks (a bind to port 0)
    comes from the ephemeral range, where every outgoing connection also takes its local port (a
    tensor-parallel rank's gloo mesh, an HTTP client), and one of those took a router's control
    port in a test run. So the port is drawn at random from the FREE_PORTS_BELOW_EPHEMERAL ports
    below that range, where only another free_port (or a fixed port) can land, and checked by a
    bind; the kernel's pick where there is no room below the range or nothing there binds. A
    process never hands out the same port twice from that range."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host if host not in ("*", "") else ("::" if family == socket.AF_INET6 else "0.0.0.0")
    low = ephemeral_ports()[0]
    first = max(1024, low - FREE_PORTS_BELOW_EPHEMERAL)
    for _ in range(32 if low - first >= 1000 else 0):
        port = _random.randrange(first, low)
        if port in _handed:
            continue
        with socket.socket(family) as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket(family) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def stop_processes(procs: list[subprocess.Popen], timeout_s: float) -> list[int]:
    """SIGTERM every process still running, SIGKILL those that outlive `timeout_s` (all of them
    together); returns the indexes of those killed."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    killed = []
    for i, proc in enumerate(procs):
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(i)
    return killed
