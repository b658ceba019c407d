"""Local child processes, as the commands that supervise some (`pdserve serve`, `pdserve router
--api-server-count`) start and stop them: a free port to give one, and stopping a set of them."""

from __future__ import annotations

import signal
import socket
import subprocess
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (an IPv6 address, bracketed or not, or "*" for any)."""
    host = host.strip("[]")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host if host not in ("*", "") else "0.0.0.0", 0))
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
