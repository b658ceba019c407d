"""Whether the router's HTTP port is free, checked before any process starts (`pdserve router
--api-server-count N` and `pdserve serve`), so a taken port fails at once with one clear line."""

from __future__ import annotations

import errno
import socket


def check_port_free(host: str, port: int) -> str | None:
    """An error line if nothing could listen on host:port now, else None. Binds each address the
    host resolves to as the router's server will (SO_REUSEADDR, so TIME_WAIT is no obstacle)."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"cannot resolve --host {host}: {e.strerror}"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return f"port {port} on {host} is already in use (pass --port to pick another)"
                return f"cannot listen on {host} port {port}: {e.strerror}"
    return None
