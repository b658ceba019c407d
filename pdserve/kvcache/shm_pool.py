"""A KV pool in POSIX shared memory (a file in /dev/shm), for the same-host fast path on the CPU.

The prefill node allocates its pool here and names the segment in its handshake; a decode node on
the same host maps it (`map_segment`) and copies a request's blocks straight out of it. "Same
host" is proved, not assumed: the segment ends with a random probe token (after the pool's bytes,
in the same memory), and the peer maps the segment only if the size is right and the token it
reads there equals the one sent in the handshake. A same-named file on another machine fails that
check. Tensor-parallel ranks of one node share their pools the same way.

Segment name: ``pdserve-<prefix>-<pidns>-<pid>-<nonce>`` (pidns: the inode of the owner's pid
namespace; for people reading /dev/shm). The owner holds a shared `flock` on the segment for as
long as it lives, and the kernel drops it when the process dies, however it dies. The owner
unlinks the segment on `close()` and at exit; one killed with -9 leaves it behind, and the next
prefill node's `cleanup_stale_segments` unlinks every segment nobody holds that lock on: in its
own pid namespace or another's (containers sharing one /dev/shm volume each have their own).
Mappings that are open stay valid after an unlink.
"""

from __future__ import annotations

import atexit
import fcntl
import hmac
import logging
import math
import mmap
import os
import re
import secrets
import time

import torch

from pdserve.kvcache.dtypes import dtype_name

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-"
PROBE_BYTES = 16  # the probe token's length; the segment reserves 64 bytes for it
_TAIL_BYTES = 64
STALE_GRACE_S = 10.0  # a segment younger than this is never judged stale (its owner may be locking it)
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

    def __init__(self, name: str, tensor: torch.Tensor, probe_token: str, lock_fd: int | None = None):
        self.name = name
        self.tensor = tensor
        self.probe_token = probe_token  # hex
        self._lock_fd = lock_fd  # holds the owner's flock: "alive" to cleanup_stale_segments
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
            fcntl.flock(fd, fcntl.LOCK_SH)  # held until this process closes it or dies
            os.posix_fallocate(fd, 0, nbytes + _TAIL_BYTES)
            mem = mmap.mmap(fd, nbytes + _TAIL_BYTES, flags=_MAP_FLAGS)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        mem[nbytes:nbytes + PROBE_BYTES] = probe
        raw = torch.frombuffer(mem, dtype=torch.uint8)  # keeps the mapping alive
        tensor = raw[:nbytes].view(dtype).view(shape)
        return cls(name, tensor, probe.hex(), lock_fd=fd)

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
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SharedKVPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def map_segment(name: str, probe_token: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """Map another process's pool of `shape` and `dtype` if its segment `name` is here, has exactly
    the size they imply, and carries `probe_token` (hex); else None (never raises for a missing,
    foreign or mismatched segment)."""
    if not name or not _NAME_RE.match(name):
        return None
    try:
        probe = bytes.fromhex(probe_token)
    except ValueError:
        return None
    if len(probe) != PROBE_BYTES or min(shape) <= 0:
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


def _owner_dead(path: str, grace_s: float) -> bool:
    """True if the segment is older than grace_s and no process holds its owner's lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        if time.time() - os.fstat(fd).st_mtime < grace_s:
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when fd closes
        return True
    except OSError:  # BlockingIOError: its owner is alive
        return False
    finally:
        os.close(fd)


def cleanup_stale_segments(shm_dir: str = SHM_DIR, grace_s: float = STALE_GRACE_S) -> list[str]:
    """Unlink pdserve segments whose owner is dead (nobody holds the owner's flock), whichever pid
    namespace it ran in; returns their names. Segments younger than `grace_s` are left alone."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in names:
        if _NAME_RE.match(name) and _owner_dead(os.path.join(shm_dir, name), grace_s):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except OSError:
                continue
    if removed:
        log.info("removed %d stale KV segment(s): %s", len(removed), ", ".join(removed))
    return removed
