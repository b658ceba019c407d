"""Secure by default beyond loopback: which ZMQ sockets are reachable from other machines, and the
refusal to run them there without CURVE keys.

A ZMQ socket without CURVE admits anyone who can reach it: a process that connects to the router's
control socket can register as a node and be sent users' prompts, and one that binds where a
prefill node hands KV over receives prompts and KV. So every pdserve process checks, before it
loads anything, that each socket it binds or connects is either on this machine (ipc://,
inproc://, tcp to a loopback address) or authenticated with `--zmq-curve-keys`; `--insecure`
overrides the check for a trusted, isolated network and logs a warning on every start.

Names are never resolved: `tcp://router:5555` counts as exposed, and so do wildcard binds
(`tcp://*:5555`, `0.0.0.0`, `::`), interface names and any address that is not plainly local.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging

LOCAL_TRANSPORTS = ("ipc://", "inproc://")
KEYS_HINT = ("create them with `pdserve keys DIR` and pass --zmq-curve-keys DIR to every pdserve process, "
             "or pass --insecure on a trusted, isolated network")
INSECURE_HELP = ("run without CURVE keys even where a ZMQ socket is reachable from other machines (a bind or "
                 "connect address other than loopback/ipc): anyone who can reach it can then register as a node, "
                 "read prompts and inject tokens. Reasonable only on a trusted, isolated network (a private "
                 "compose or cluster network nothing else joins); logs a warning at every start "
                 "(default: off, such a start is refused)")


class InsecureExposureError(ValueError):
    """A socket would be reachable beyond this machine without CURVE keys (and no --insecure)."""


def is_local_host(host: str) -> bool:
    """`localhost` or a loopback IP literal (127.0.0.0/8, ::1, with or without [] around IPv6).
    Wildcards, other addresses, interface names and hostnames (never resolved) are not local."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback  # an IPv6 zone id (::1%lo) aside
    except ValueError:
        return False


def is_local(addr: str) -> bool:
    """A ZMQ endpoint that only this machine can reach: ipc://, inproc://, or tcp:// to a loopback
    host (`tcp://127.0.0.1:5555`, `tcp://localhost:0`, `tcp://[::1]:5555`). A connect with a source
    (`tcp://SRC;DEST:PORT`) is local only if both are. Every other transport or form is not."""
    addr = addr.strip()
    if addr.startswith(LOCAL_TRANSPORTS):
        return True
    if not addr.startswith("tcp://"):
        return False
    rest = addr[len("tcp://"):]
    hosts = []
    for part in rest.split(";"):  # HOST:PORT, or a source part that may lack the port
        host, sep, _ = part.rpartition(":")
        hosts.append(host if sep and not part.endswith("]") else part)
    return all(host and is_local_host(host) for host in hosts)


def exposure_message(addr: str, what: str, *, connect: bool = False) -> str:
    where = f"connect to the {what} at {addr}" if connect else f"bind the {what} on {addr}"
    return f"refusing to {where} without CURVE keys: {KEYS_HINT}"


def check_exposed(addr_or_host: str, curve, insecure: bool, what: str, *, connect: bool = False) -> None:
    """Raise InsecureExposureError (one line) if `addr_or_host` (a ZMQ address, or a bare bind
    host) is reachable beyond this machine while there are no CURVE keys and no --insecure."""
    if curve or insecure or _local(addr_or_host):
        return
    raise InsecureExposureError(exposure_message(addr_or_host, what, connect=connect))


def _local(addr_or_host: str) -> bool:
    return is_local(addr_or_host) if "://" in addr_or_host else is_local_host(addr_or_host)


# ---- what each command exposes --------------------------------------------------------------------
def router_sockets(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(address, what, connect) of every ZMQ socket `pdserve router` opens."""
    return [(args.control_addr, "control socket", False)]


def node_sockets(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(address, what, connect) of the ZMQ sockets a node opens at start: the link to the router,
    and a decode node's KV socket (bound on `tcp://{--host}:{--kv-port}`). A prefill node's KV
    connections go where the router says at run time; KVSender checks each one."""
    routers = [args.router] if isinstance(args.router, str) else args.router  # --router repeats, takes comma lists
    sockets = [(addr.strip(), "router's control socket", True) for value in routers for addr in value.split(",")
               if addr.strip()]
    if getattr(args, "role", None) == "decode":
        sockets.append((f"tcp://{_bracketed(args.host)}:{args.kv_port}", "KV socket", False))
    return sockets


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def exposed_sockets(sockets: list[tuple[str, str, bool]]) -> list[tuple[str, str, bool]]:
    return [s for s in sockets if not _local(s[0])]


def check_sockets(sockets: list[tuple[str, str, bool]], curve, insecure: bool) -> None:
    """check_exposed for each socket: the first exposed one raises."""
    for addr, what, connect in sockets:
        check_exposed(addr, curve, insecure, what, connect=connect)


def warn_insecure(logger: logging.Logger, what_list: list[str]) -> None:
    """The WARNING a --insecure start logs (every time) naming its sockets that other machines can
    reach without authentication (`what_list`: "the control socket bound on tcp://0.0.0.0:5555")."""
    if not what_list:
        return
    logger.warning(
        "--insecure: no CURVE authentication or encryption on %s, reachable from other machines: anyone on "
        "that network can register as a node and be sent users' prompts, read prompts and KV off the wire, and "
        "inject tokens into responses. Use --insecure only on a trusted, isolated network; otherwise create keys "
        "with `pdserve keys DIR` and pass --zmq-curve-keys DIR to every pdserve process", " and ".join(what_list))


def describe(addr: str, what: str, connect: bool) -> str:
    return f"the connection to the {what} at {addr}" if connect else f"the {what} bound on {addr}"


def check_or_warn(sockets: list[tuple[str, str, bool]], curve, insecure: bool, logger: logging.Logger) -> None:
    """A process's start-up check: raise for an exposed socket without keys, or (with --insecure
    and no keys) log the warning naming every exposed socket."""
    check_sockets(sockets, curve, insecure)
    if not curve:
        warn_insecure(logger, [describe(*s) for s in exposed_sockets(sockets)])
