"""A KV pool in POSIX shared memory (a file in /dev/shm), for the same-host fast path on the CPU.

The prefill node allocates its pool here and names the segment in its handshake; a decode node on
the same host maps it and copies a request's blocks straight out of it. "Same host" is proved, not
assumed: the segment ends with a random probe token (after the pool's bytes, in the same memory),
and the peer maps the segment only if the size is right and the token it reads there equals the
one sent in the handshake. A same-named file on another machine fails that check.

Segment name: ``pdserve-<prefix>-<pidns>-<pid>-<nonce>`` where pidns is the inode of the owner's
pid namespace, so `cleanup_stale_segments` only judges pids it can actually see. The owner
unlinks the segment on `close()` and at exit; a node killed with -9 leaves it behind for the next
start's cleanup. Mappings that are open stay valid after an unlink.

`SharedMemoryTransport` ("shm") is the receiver's side of this path (kvtransfer.transport): its
probe is `open_peer_pool`, and a transfer is one pool-to-pool copy out of the mapped segment.
"""

from __future__ import annotations

import atexit
import hmac
import logging
import math
import mmap
import os
import re
import secrets

import torch

from pdserve.kvtransfer.layout import layout_shape
from pdserve.kvtransfer.messages import KVLayout
from pdserve.kvtransfer.payload import DTYPES, dtype_name
from pdserve.kvtransfer.transport import PeerPoolCopy, Send

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-"
PROBE_BYTES = 16  # the probe token's length; the segment reserves 64 bytes for it
_TAIL_BYTES = 64
_NAME_RE = re.compile(r"^pdserve-[A-Za-z0-9_]+-\d+-\d+-[0-9a-f]+$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _pool_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class SharedKVPool:
    """A pool tensor backed by a /dev/shm segment that this process owns."""

    def __init__(self, name: str, tensor: torch.Tensor, probe_token: str):
        self.name = name
        self.tensor = tensor
        self.probe_token = probe_token  # hex
        self._closed = False
        atexit.register(self.close)

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    @classmethod
    def create(cls, name_prefix: str, shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> SharedKVPool:
        """Allocate a zero-filled segment for a pool of `shape` and `dtype`.

        The memory is reserved up front (fallocate), so a full /dev/shm (Docker's default is
        64 MiB) raises OSError here instead of a SIGBUS on first touch; callers fall back to a
        private pool.
        """
        dtype_name(dtype)  # only wire dtypes
        prefix = re.sub(r"[^A-Za-z0-9_]", "_", name_prefix) or "pool"
        name = f"{PREFIX}{prefix}-{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(6)}"
        shape = tuple(int(n) for n in shape)
        nbytes = _pool_nbytes(shape, dtype)
        probe = secrets.token_bytes(PROBE_BYTES)
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes + _TAIL_BYTES)
            mem = mmap.mmap(fd, nbytes + _TAIL_BYTES, flags=_MAP_FLAGS)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        mem[nbytes:nbytes + PROBE_BYTES] = probe
        raw = torch.frombuffer(mem, dtype=torch.uint8)  # keeps the mapping alive
        tensor = raw[:nbytes].view(dtype).view(shape)
        return cls(name, tensor, probe.hex())

    def close(self) -> None:
        """Unlink the segment (idempotent). Tensors already mapped stay usable until dropped."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> SharedKVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_peer_pool(layout: KVLayout, probe_token: str) -> torch.Tensor | None:
    """Map a peer's pool if its segment is here, has the size `layout` implies, and carries
    `probe_token`; else None (never raises for a missing, foreign or mismatched segment)."""
    name = layout.shm_name
    if not name or not _NAME_RE.match(name) or layout.dtype not in DTYPES:
        return None
    try:
        probe = bytes.fromhex(probe_token)
    except ValueError:
        return None
    if len(probe) != PROBE_BYTES:
        return None
    dtype = DTYPES[layout.dtype]
    shape = layout_shape(layout)
    if min(shape) <= 0:
        return None
    nbytes = _pool_nbytes(shape, dtype)
    mem = _map_exact(os.path.join(SHM_DIR, name), nbytes + _TAIL_BYTES)
    if mem is None:
        return None
    if not hmac.compare_digest(mem[nbytes:nbytes + PROBE_BYTES], probe):
        log.info("shm segment %s: probe token mismatch, not the peer's memory", name)
        mem.close()
        return None
    raw = torch.frombuffer(mem, dtype=torch.uint8)
    return raw[:nbytes].view(dtype).view(shape)


class SharedMemoryTransport(PeerPoolCopy):
    """Same host, CPU pools: the handle is the peer's pool mapped from its segment."""

    name = "shm"

    def open(self, peer_layout: KVLayout, send: Send) -> torch.Tensor | None:
        return open_peer_pool(peer_layout, peer_layout.probe_token)


# Map every page at once: the pool is resident from the start, like a private pool (torch.zeros
# touches its pages), so a node's RSS does not creep up as requests reach new blocks.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _map_exact(path: str, size: int) -> mmap.mmap | None:
    """mmap an existing file of exactly `size` bytes (checked on the open fd, no TOCTOU)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            log.info("shm segment %s: size %d, expected %d", path, os.fstat(fd).st_size, size)
            return None
        return mmap.mmap(fd, size, flags=_MAP_FLAGS)
    except OSError:
        return None
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):
        return False
    return True


def cleanup_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink pdserve segments whose owner (in our pid namespace) is dead; returns their names."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    pidns = str(_pid_namespace())
    removed = []
    for name in names:
        if not _NAME_RE.match(name):
            continue
        _, ns, pid, _ = name.rsplit("-", 3)
        if ns != pidns or _pid_alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except OSError:
            continue
    if removed:
        log.info("removed %d stale KV segment(s): %s", len(removed), ", ".join(removed))
    return removed
