"""`pdserve router --api-server-count N`: N router processes behind one HTTP port, each with its
own control socket, supervised by the process the user started.

    parent   checks the port and every control address, starts the N children, prints where
             nodes find them (`--router A,B,...`), restarts a child that dies (a crash loop,
             MAX_RESTARTS within RESTART_WINDOW_S, stops them all), and on SIGTERM/SIGINT stops
             them all: SIGTERM (each finishes its streams), then SIGKILL after STOP_TIMEOUT_S. A
             child is killed when its parent dies (PR_SET_PDEATHSIG), so no path leaves one
             behind, and a parent started again finds the control ports free.
    child i  a plain `pdserve router` on control address i, its HTTP socket opened with
             SO_REUSEPORT: the kernel spreads new connections over the N processes. Every
             response carries `X-Pdserve-Api-Server: i`, so a client (or a test) can tell which
             process served it; /metrics on the shared port answers for whichever process
             accepted the connection.

Nodes register with every child (`--router` lists them all); each child dispatches and streams
its own clients' requests and sees every node's load through the heartbeats (node/router_links.py).
A child that dies loses only its own clients' streams; the nodes free its requests.
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time

from pdserve.utils.processes import free_port, stop_processes

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
STOP_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1


def control_addresses(control_addr: str, count: int) -> list[str]:
    """The N control addresses: a comma list of N as given, or one `tcp://HOST:PORT` taken as the
    first of N consecutive ports (port 0: N free ports). ValueError (one line) otherwise."""
    given = [a.strip() for a in control_addr.split(",") if a.strip()]
    if len(given) == count:
        return given
    if len(given) != 1:
        raise ValueError(f"--control-addr: {len(given)} addresses for --api-server-count {count} "
                         "(give one tcp://HOST:PORT, or exactly one address per API server)")
    host, sep, port = given[0].rpartition(":")
    if not given[0].startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"--control-addr {given[0]!r}: with --api-server-count {count}, give tcp://HOST:PORT "
                         "or a comma list of one address per API server")
    first = int(port)
    if first == 0:
        return [f"{host}:{free_port(host[len('tcp://'):])}" for _ in range(count)]
    if first + count - 1 > 65535:
        raise ValueError(f"--control-addr: ports {first}..{first + count - 1} do not all exist")
    return [f"{host}:{first + i}" for i in range(count)]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's stop path still ends them
        pass


class ApiServers:
    """The children, from their argv (one per API server) to their end."""

    def __init__(self, commands: list[list[str]]) -> None:
        self.commands = commands
        self.procs: list[subprocess.Popen] = []
        self._restarts: list[list[float]] = [[] for _ in commands]

    def start(self, i: int) -> subprocess.Popen:
        proc = subprocess.Popen(self.commands[i], preexec_fn=_die_with_parent)
        if i < len(self.procs):
            self.procs[i] = proc
        else:
            self.procs.append(proc)
        print(f"pdserve router: API server {i} started (pid {proc.pid})", flush=True)
        return proc

    def supervise(self, stopping: list[bool], poll_s: float = 0.2) -> int:
        """Restart children that die until asked to stop (0), or until one keeps dying (1)."""
        while not stopping[0]:
            for i, proc in enumerate(self.procs):
                if proc.poll() is None or stopping[0]:
                    continue
                now = time.monotonic()
                recent = [t for t in self._restarts[i] if now - t < RESTART_WINDOW_S]
                if len(recent) >= MAX_RESTARTS:
                    print(f"pdserve router: API server {i} exited ({proc.returncode}) {len(recent) + 1} times "
                          f"within {RESTART_WINDOW_S:g} s; stopping", file=sys.stderr, flush=True)
                    return 1
                print(f"pdserve router: API server {i} exited ({proc.returncode}); restarting it",
                      file=sys.stderr, flush=True)
                self._restarts[i] = [*recent, now]
                self.start(i)
            time.sleep(poll_s)
        return 0

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> list[int]:
        """SIGTERM every child (they finish their streams), SIGKILL what outlives `timeout_s`;
        returns the indexes of those killed."""
        return stop_processes(self.procs, timeout_s)


def run_api_servers(commands: list[list[str]]) -> int:
    """Start the children, supervise them until SIGTERM/SIGINT or a crash loop, stop them all."""
    stopping = [False]

    def on_signal(signum, frame) -> None:
        stopping[0] = True

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    servers = ApiServers(commands)
    try:
        for i in range(len(commands)):
            servers.start(i)
        return servers.supervise(stopping)
    finally:
        killed = servers.stop()
        print(f"pdserve router: stopped {len(servers.procs)} API servers"
              + (f" (killed {', '.join(map(str, killed))})" if killed else ""), file=sys.stderr, flush=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
