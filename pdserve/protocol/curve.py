"""Optional CURVE authentication and encryption for every pdserve ZMQ socket.

One key directory (``pdserve keys DIR``) is shared by every process of a deployment:

    server.key / server.key_secret   every socket that binds: the router's control ROUTER and
                                     each decode node's KV ROUTER (`apply_server`)
    client.key / client.key_secret   every socket that connects: the nodes' DEALERs to the router
                                     and the prefill node's KV DEALERs (`apply_client`)
    *.key                            the public keys allowed to connect (client.key, plus any
                                     other client's public certificate dropped in)

CURVE alone encrypts, but libzmq lets in any client that knows the server's *public* key unless a
ZAP handler answers for the socket's context. So `apply_server` first starts a ZAP authenticator
(pyzmq's ThreadAuthenticator, one per context, in a thread of its own) that admits only the
allowed keys; it works on a plain `zmq.Context` and on the router's `zmq.asyncio.Context` alike.
Stop it with `stop_authenticator(ctx)` before `ctx.term()`, or term() waits forever.

A peer without the keys (or with keys not in the allowed set) never completes a handshake: its
messages stay queued on its side, nothing reaches the other end, and libzmq keeps retrying the
connection. For the KV hand-off that means the decode node never sees the KVReady and the
prefill node's lease runs out and releases the blocks; a node never registers with the router.

Refusals are counted (`pdserve_auth_refusals_total{reason}` on the router and on decode nodes)
from two sources, because libzmq asks ZAP only about peers that got that far:

    unknown_key   the ZAP callback refused a client key that is not in the allowed set (the
                  client knew our server's public key). Reported by `_AllowedKeys` through
                  `apply_server(..., on_refused=...)`; libzmq then also emits
                  HANDSHAKE_FAILED_AUTH on the socket's monitor, which is not counted again.
    no_curve      HANDSHAKE_FAILED_PROTOCOL with ZMTP_MECHANISM_MISMATCH: a plain (keyless) peer.
    handshake     any other failed handshake (HANDSHAKE_FAILED_PROTOCOL, e.g. a client of
                  another key directory, whose HELLO is not encrypted for our server key, or
                  HANDSHAKE_FAILED_NO_DETAIL: a peer that hung up mid-handshake, which a keyless
                  peer sometimes does too).

`monitor_handshakes(sock)` opens the monitor socket for those events and `HandshakeFailures`
turns its events into reasons, logging the first one and then at most one line a minute with a
count (libzmq does not say who a keyless peer is; every peer retries about every 100 ms). Each
socket given `on_refused` gets a ZAP domain of its own, so two bound sockets of one context
(tests hold many) count only their own refusals. `node_id_taken` is the router's (handlers.py).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SERVER, CLIENT = "server", "client"  # certificate base names in the key directory
ZAP_DOMAIN = "pdserve"
# pdserve_auth_refusals_total{reason}: the first three on every bound CURVE socket, the last on the router
AUTH_REFUSAL_REASONS = ("unknown_key", "no_curve", "handshake", "node_id_taken")
SOCKET_REFUSAL_REASONS = AUTH_REFUSAL_REASONS[:3]
OnRefused = Callable[[str, str], None]  # (reason, peer description); may run in the ZAP thread
HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_domain_ids = itertools.count(1)


def generate_keys(directory: str | os.PathLike, *, force: bool = False) -> Path:
    """Write a server and a client keypair (pyzmq certificate files) into `directory`, creating it
    with mode 0700. Secret files are 0600 from the moment they exist. Refuses to replace existing
    keys (FileExistsError) unless `force`."""
    directory = Path(directory)
    names = [f"{name}{ext}" for name in (SERVER, CLIENT) for ext in (".key", ".key_secret")]
    existing = [n for n in names if (directory / n).exists()]
    if existing and not force:
        raise FileExistsError(f"{directory} already holds {', '.join(existing)}; use --force to replace them")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in (SERVER, CLIENT):
        secret = directory / f"{name}.key_secret"
        secret.unlink(missing_ok=True)
        os.close(os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))  # pyzmq truncates, keeps the mode
        zmq.auth.create_certificates(directory, name)
    return directory


@dataclass(frozen=True)
class CurveKeys:
    """Z85-encoded keys (40 bytes each), as libzmq's socket options take them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    allowed_client_keys: frozenset[bytes]  # public keys the ZAP authenticator lets connect

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CurveKeys:
        directory = Path(directory)
        server_public, server_secret = _load_secret(directory, SERVER)
        client_public, client_secret = _load_secret(directory, CLIENT)
        allowed = frozenset(zmq.auth.load_certificates(directory))
        return cls(server_public, server_secret, client_public, client_secret, allowed)


def _load_secret(directory: Path, name: str) -> tuple[bytes, bytes]:
    path = directory / f"{name}.key_secret"
    if not path.is_file():
        raise FileNotFoundError(f"no CURVE key file {path}; run `pdserve keys {directory}` to create the keys")
    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path} holds no secret-key; run `pdserve keys {directory} --force` to recreate the keys")
    return public, secret


def apply_server(sock: zmq.Socket, keys: CurveKeys, *, on_refused: OnRefused | None = None) -> str:
    """Make `sock` (before it binds) a CURVE server whose clients the authenticator checks.
    With `on_refused`, the socket gets a ZAP domain of its own and `on_refused("unknown_key", key)`
    is called (in the authenticator's thread) for every client key refused on it. Returns the ZAP
    domain (give it to `forget_domain` when the socket closes)."""
    domain = ZAP_DOMAIN if on_refused is None else f"{ZAP_DOMAIN}-{next(_domain_ids)}"
    start_authenticator(sock.context, keys, domain=domain, on_refused=on_refused)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    return domain


def apply_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it connects) a CURVE client of the servers that hold `keys`."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


# ---- ZAP: one authenticator per context (libzmq allows one handler per context) -----------------
class _AllowedKeys:
    """pyzmq credentials provider: admit a client whose public key is in the set."""

    def __init__(self, keys: frozenset[bytes], on_refused: OnRefused | None = None):
        self.keys = keys
        self.on_refused = on_refused
        self._refused: set[bytes] = set()  # warn once per key: a refused peer retries every 100 ms

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if self.on_refused is not None:
            try:
                self.on_refused("unknown_key", key.decode())
            except Exception:  # a counting bug must not turn into letting the peer in
                log.exception("on_refused failed")
        if key not in self._refused:
            self._refused.add(key)
            log.warning("refused a ZMQ CURVE client with unknown public key %s", key.decode())
        return False


_authenticators: dict[zmq.Context, tuple[ThreadAuthenticator, frozenset[bytes]]] = {}
_lock = threading.Lock()


def start_authenticator(ctx: zmq.Context, keys: CurveKeys, *, domain: str = ZAP_DOMAIN,
                        on_refused: OnRefused | None = None) -> ThreadAuthenticator:
    """Run a ZAP handler on `ctx` admitting only `keys.allowed_client_keys` for sockets of ZAP
    `domain`; idempotent per context (a new domain is added to the running handler). Raises
    ValueError if one already runs there with another key set."""
    with _lock:
        running = _authenticators.get(ctx)
        if running is not None:
            auth, allowed = running
            if allowed != keys.allowed_client_keys:
                raise ValueError("a ZAP authenticator with other allowed keys already runs on this context")
        else:
            auth = _start_zap_thread(ctx)
            _authenticators[ctx] = (auth, keys.allowed_client_keys)
        if domain not in auth.credentials_providers or on_refused is not None:
            # A dict entry the ZAP thread reads per request: safe to add while it runs.
            auth.configure_curve_callback(domain, credentials_provider=_AllowedKeys(keys.allowed_client_keys,
                                                                                    on_refused))
        return auth


def forget_domain(ctx: zmq.Context, domain: str) -> None:
    """Drop a socket's own ZAP domain (see `apply_server`) once the socket is closed."""
    with _lock:
        running = _authenticators.get(ctx)
    if running is not None and domain != ZAP_DOMAIN:
        running[0].credentials_providers.pop(domain, None)


def monitor_handshakes(sock: zmq.Socket) -> zmq.Socket:
    """A monitor socket (PAIR; asyncio if `sock` is) reporting `sock`'s failed handshakes. Close it
    with `close_monitor` before the socket's context terminates."""
    return sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)


def close_monitor(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    if not sock.closed:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
    monitor.close(linger=0)


def close_server(sock: zmq.Socket, monitor: zmq.Socket | None, *, linger: int = 0) -> None:
    """Close a bound socket with its handshake monitor (if any), and drop its own ZAP domain.
    Closing twice is a no-op, as for a plain socket."""
    if monitor is not None:
        close_monitor(sock, monitor)
    if sock.closed:
        return
    domain = sock.getsockopt(zmq.ZAP_DOMAIN).decode()
    sock.close(linger=linger)
    if domain:
        forget_domain(sock.context, domain)


def handshake_failure_reason(event: int, value: int) -> str | None:
    """The refusal reason of a monitor event, None when it is not counted: HANDSHAKE_FAILED_AUTH
    follows a ZAP refusal, already counted as unknown_key by the ZAP callback."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "no_curve"
    if event in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
        return "handshake"
    return None


class HandshakeFailures:
    """Turns one bound socket's monitor events into refusals: `on_event(event)` calls
    `on_refused(reason, "")` for each counted failure and logs the first failure, then at most one
    line per `log_every_s` with the count since the last line (libzmq does not name the peer)."""

    def __init__(self, what: str, on_refused: OnRefused, *, log_every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what  # e.g. "control socket tcp://0.0.0.0:5555"
        self.on_refused = on_refused
        self.log_every_s = log_every_s
        self.clock = clock
        self._last_log: float | None = None
        self._unlogged = 0

    def on_event(self, event: dict) -> str | None:
        """Count one monitor message (from `recv_monitor_message`); returns its reason, if counted."""
        reason = handshake_failure_reason(int(event["event"]), int(event["value"]))
        if reason is None:
            return None
        self.on_refused(reason, "")
        self._unlogged += 1
        now = self.clock()
        if self._last_log is None or now - self._last_log >= self.log_every_s:
            if self._last_log is None:
                log.warning("%s refused a peer: ZMQ handshake failed (%s; a plain peer without the CURVE "
                            "keys, or keys of another key directory)", self.what, reason)
            else:
                log.warning("%s refused %d more ZMQ handshakes in the last %.0f s (latest: %s)", self.what,
                            self._unlogged, now - self._last_log, reason)
            self._last_log, self._unlogged = now, 0
        return reason


def _start_zap_thread(ctx: zmq.Context, retry_s: float = 2.0) -> ThreadAuthenticator:
    """Start a ThreadAuthenticator, retrying while the previous one's ZAP endpoint is still bound:
    a closed socket lets go of its inproc address only when libzmq's reaper gets to it, so a stop
    followed at once by a start on the same context can find "inproc://zeromq.zap.01" in use."""
    deadline = time.monotonic() + retry_s
    while True:
        auth = ThreadAuthenticator(ctx)
        try:
            auth.start()
            return auth
        except zmq.ZMQError as e:
            for sock in (auth.zap_socket, auth.pipe):  # whatever it opened before the bind failed
                if sock is not None and not sock.closed:
                    sock.close(0)
            auth.zap_socket = auth.pipe = None
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the context's authenticator (call before ctx.term()); no-op if none runs."""
    with _lock:
        running = _authenticators.pop(ctx, None)
    if running is not None:
        running[0].stop()


def keys_main(argv: list[str] | None = None) -> int:
    """`pdserve keys DIR [--force]`."""
    p = argparse.ArgumentParser(prog="pdserve keys", description="Create the CURVE keys for --zmq-curve-keys.")
    p.add_argument("dir", type=Path, help="directory to create (mode 0700)")
    p.add_argument("--force", action="store_true", help="replace existing keys")
    args = p.parse_args(argv)
    try:
        directory = generate_keys(args.dir, force=args.force)
    except FileExistsError as e:
        print(f"pdserve keys: {e}", file=sys.stderr)
        return 1
    print(f"wrote CURVE keys to {directory}/: server.key, server.key_secret, client.key, client.key_secret\n"
          f"give every pdserve process (router and nodes) --zmq-curve-keys {directory}; to admit another client,\n"
          f"copy its public .key file into {directory}")
    return 0


main = keys_main  # `pdserve keys` dispatches to the module's main
