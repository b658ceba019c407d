"""Where a node's routers are: the `--router` values, each resolved to every address it names.

A value is a ZMQ address (`tcp://HOST:PORT`, `ipc://...`); the flag repeats and takes comma
lists. Routers started with `--api-server-count N` listen on N consecutive control ports: a node
given the same `--api-server-count N` takes each tcp address as the first of N. A tcp host name is resolved to all its addresses, one router per address: on Kubernetes
a headless Service's name resolves to every router pod, so `--router tcp://pdserve-router-nodes:5555`
finds them all. Names are resolved again every `refresh_s` in a thread of their own (a DNS
lookup must not stall the node's loop), so routers that come later are found and those whose
address left the name are dropped. A name that does not resolve (no router pod yet) keeps what it
last resolved to; the node simply has no router for it until it does.

Addresses are written the same way on every node (`tcp://IP:PORT`), so that a router named by a
prefill node in a KVReady (`KVReady.router`) is recognised by the decode node: nodes must name
their routers alike (the same list, or the same DNS name).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

TRANSPORTS = ("tcp://", "ipc://", "inproc://")
DEFAULT_REFRESH_S = 10.0

Resolver = Callable[[str, int], list[str]]  # (host, port) -> IP addresses


def parse_router_specs(values: str | Iterable[str], ports_per_router: int = 1) -> list[str]:
    """`--router` values (repeated, comma lists) as a list of addresses, duplicates dropped. With
    `ports_per_router` N (routers started with --api-server-count N), a tcp address stands for N
    consecutive ports from its own. ValueError (one line) for an empty list or an address that is
    not tcp://HOST:PORT, ipc:// or inproc://."""
    if ports_per_router < 1:
        raise ValueError(f"--api-server-count: {ports_per_router} is not a process count (1 or more)")
    raw = [values] if isinstance(values, str) else list(values)
    specs: list[str] = []
    for value in raw:
        for spec in (s.strip() for s in value.split(",")):
            if not spec:
                continue
            if not spec.startswith(TRANSPORTS):
                raise ValueError(f"--router {spec!r}: expected tcp://HOST:PORT, ipc://PATH or inproc://NAME")
            expanded = [spec]
            if spec.startswith("tcp://"):
                _, port = _split_tcp(spec)
                if port + ports_per_router - 1 > 65535:
                    raise ValueError(f"--router {spec!r}: {ports_per_router} ports from {port} do not all exist")
                base = spec[:spec.rindex(":") + 1]
                expanded = [f"{base}{port + i}" for i in range(ports_per_router)]
            specs += [s for s in expanded if s not in specs]
    if not specs:
        raise ValueError("--router: no router address given")
    return specs


def _split_tcp(spec: str) -> tuple[str, int]:
    host, sep, port = spec[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--router {spec!r}: expected tcp://HOST:PORT with a port in 1..65535")
    return host.strip("[]"), int(port)


def system_resolver(host: str, port: int) -> list[str]:
    """Every IPv4 address of `host` (IPv6 when it has none), sorted; OSError when it has none."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    return v4 or sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})


def resolve(spec: str, resolver: Resolver = system_resolver) -> list[str]:
    """The router addresses `spec` stands for (tcp: one per IP of its host; others: itself)."""
    if not spec.startswith("tcp://"):
        return [spec]
    host, port = _split_tcp(spec)
    return [f"tcp://{_bracketed(ip)}:{port}" for ip in resolver(host, port)]


def _bracketed(ip: str) -> str:
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip.split("%", 1)[0]).version == 6 else ip
    except ValueError:
        return ip


class RouterDiscovery:
    """The current router addresses of a node (`addresses`), resolved at once and then every
    `refresh_s` by a daemon thread (0: never again). Reading `addresses` is all the loop does."""

    def __init__(self, specs: list[str], *, refresh_s: float = DEFAULT_REFRESH_S,
                 resolver: Resolver = system_resolver) -> None:
        self.specs = specs
        self.refresh_s = refresh_s
        self.resolver = resolver
        self._by_spec: dict[str, list[str]] = {}
        self.addresses: tuple[str, ...] = ()  # replaced whole (one assignment), never mutated
        self.resolve_now()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if refresh_s > 0 and any(s.startswith("tcp://") for s in specs):
            self._thread = threading.Thread(target=self._run, daemon=True, name="router-discovery")
            self._thread.start()

    def resolve_now(self) -> tuple[str, ...]:
        for spec in self.specs:
            try:
                found = resolve(spec, self.resolver)
            except OSError as e:  # not (yet) in DNS: keep what it resolved to last
                if spec not in self._by_spec:
                    logger.warning("router %s does not resolve (yet): %s; trying again every %g s", spec, e,
                                   self.refresh_s)
                self._by_spec.setdefault(spec, [])
                continue
            if found != self._by_spec.get(spec):
                logger.info("router %s: %s", spec, ", ".join(found) or "no address")
            self._by_spec[spec] = found
        self.addresses = tuple(dict.fromkeys(a for spec in self.specs for a in self._by_spec[spec]))
        return self.addresses

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.resolve_now()
            except Exception:  # a resolver bug must not end discovery
                logger.exception("resolving the routers failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
