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
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SERVER, CLIENT = "server", "client"  # certificate base names in the key directory
ZAP_DOMAIN = "pdserve"


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


def apply_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it binds) a CURVE server whose clients the authenticator checks."""
    start_authenticator(sock.context, keys)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def apply_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it connects) a CURVE client of the servers that hold `keys`."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


# ---- ZAP: one authenticator per context (libzmq allows one handler per context) -----------------
class _AllowedKeys:
    """pyzmq credentials provider: admit a client whose public key is in the set."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys
        self._refused: set[bytes] = set()  # warn once per key: a refused peer retries every 100 ms

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        if key not in self._refused:
            self._refused.add(key)
            log.warning("refused a ZMQ CURVE client with unknown public key %s", key.decode())
        return False


_authenticators: dict[zmq.Context, tuple[ThreadAuthenticator, frozenset[bytes]]] = {}
_lock = threading.Lock()


def start_authenticator(ctx: zmq.Context, keys: CurveKeys) -> ThreadAuthenticator:
    """Run a ZAP handler on `ctx` admitting only `keys.allowed_client_keys`; idempotent per context.
    Raises ValueError if one already runs there with another key set."""
    with _lock:
        running = _authenticators.get(ctx)
        if running is not None:
            auth, allowed = running
            if allowed != keys.allowed_client_keys:
                raise ValueError("a ZAP authenticator with other allowed keys already runs on this context")
            return auth
        auth = _start_zap_thread(ctx)
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowedKeys(keys.allowed_client_keys))
        _authenticators[ctx] = (auth, keys.allowed_client_keys)
        return auth


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
