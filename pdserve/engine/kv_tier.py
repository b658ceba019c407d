"""A KV tier below the pool: evicted prefix-cache blocks are kept here and come back on a hit
instead of being recomputed (issue 40, part 4).

What goes where. The block manager's prefix cache keys a full, computed block by its chained hash
(engine/block_manager.py: ``key(i) = hash((key(i-1), tokens of block i))``, a Python int). When
the pool runs dry and an evictable cached block is taken for reuse (`BlockManager._pop_free`), its
bytes are first copied here under that key (`BlockTier.offload`). When a prompt's chain of
in-memory hits ends, `BlockManager.get_computed_blocks` goes on through the tier: for each next key
held here it takes a block, copies the bytes back into it (`BlockTier.load`, verified) and keys it
as cached, so the request takes it exactly like an in-memory hit; the first miss, or a block that
fails its check, ends the chain and the rest is recomputed. The tier is inclusive: a block loaded
back stays here too, so a second eviction of it costs no write.

The data of one block is the K and V of every layer for that block id: ``pool[:, :, block_id]``
of each KV pool (``[layers, 2, blocks, block_size, kv_heads, head_dim]``, engine/model_runner.py;
with a draft model its pool too, same block ids), packed as one flat byte tensor of
`block_bytes`.

Backends (`KVTier`, an abc; the block manager never sees which one):
  - `HostTier`: slots in host memory, pinned when the pool is on CUDA (the GPU node's second
    tier: a block moves over PCIe at ~25 GB/s).
  - `DiskTier`: one memory-mapped file of fixed-size slots under a directory (the CPU node's
    second tier: the pool already is host memory). Size capped (--kv-offload-gb); the file is the
    node's and is deleted on `close` (and at interpreter exit).
Both hold at most `capacity` blocks and evict the least recently used key when full. Each slot
stores the block's bytes and a blake2b digest of (key, bytes) (the disk slot also the key, in its
header); `get` recomputes the digest and compares: a mismatch drops the slot and counts as
`corrupt`, and the caller recomputes the block. A hit costs a digest (~1 GB/s a core) and a copy;
a store the same. Both run synchronously between forwards (the scheduler's thread), so nothing
writes the blocks while they are copied.

Events: every key entering or leaving the tier goes to `listener(key, stored)`; the block manager
forwards it to its KVEventLog as tier "disk" (the KVEvents protocol knows "memory" and "disk").

A remote store (Mooncake Store, LMCache's server, a Redis of blocks) plugs in by implementing the
same `KVTier` interface: `put(key, data)` (store the block's bytes; may evict and must report the
keys it drops to `listener`), `get(key)` (the bytes, verified, or None), `touch(key)`,
`__contains__` / `keys()` (a local view of what it holds: the chain walk asks per block, so it must
be cheap, e.g. a key set kept from its own put/evict notifications), `drop(key)`, `close()`. A
remote get is a network round trip per block: such a store would want a batched get of the
chain's keys (one call per prompt), which `BlockTier` could issue before loading. Keys are the node's
own chained hashes: a store shared by several nodes must use the same block size and model.

    counters: hits, misses, puts, evictions, corrupt, bytes_read, bytes_written; len(tier) keys held,
              capacity blocks, bytes_used / capacity_bytes
"""

from __future__ import annotations

import abc
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import struct
import tempfile
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DIGEST_SIZE = 32
_KEY = struct.Struct("<q")  # a Python hash: a signed 64-bit int
_HEADER = 64  # disk slot: key (8 bytes), digest (32), padding; the block's bytes start here
_GIB = 1 << 30


def _digest(key: int, data) -> bytes:
    """blake2b of (key, the block's bytes); `data` is any C-contiguous buffer."""
    h = hashlib.blake2b(_KEY.pack(key), digest_size=DIGEST_SIZE)
    h.update(data)
    return h.digest()


def _as_buffer(t: torch.Tensor):
    """A zero-copy buffer of a contiguous uint8 CPU tensor (for hashlib)."""
    return t.numpy()


class KVTier(abc.ABC):
    """Fixed-size blocks of bytes keyed by the prefix cache's chained hash, LRU, verified on read."""

    def __init__(self, block_bytes: int, capacity: int) -> None:
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1, got {block_bytes}")
        if capacity < 1:
            raise ValueError(f"a KV tier needs room for at least one block ({block_bytes} bytes), got {capacity}")
        self.block_bytes = block_bytes
        self.capacity = capacity  # blocks
        # Called with (key, True) when a key enters the tier and (key, False) when it leaves.
        self.listener: Callable[[int, bool], None] | None = None
        self.hits = 0  # gets that returned verified bytes
        self.misses = 0  # gets of a key not held
        self.puts = 0  # blocks written
        self.evictions = 0  # keys dropped to make room (LRU)
        self.corrupt = 0  # gets whose bytes failed the check (slot dropped)
        self.bytes_read = 0
        self.bytes_written = 0

    # ---- the interface --------------------------------------------------------------------
    @abc.abstractmethod
    def put(self, key: int, data: torch.Tensor) -> None:
        """Store a block's bytes (a flat uint8 tensor of `block_bytes`, any device) under `key`,
        evicting the least recently used key when full. A key already held is only refreshed
        (equal keys mean equal content)."""

    @abc.abstractmethod
    def get(self, key: int) -> torch.Tensor | None:
        """The block's bytes, verified; None on a miss or a failed check (then the slot is dropped
        and `corrupt` counts it). The tensor may be a view of the tier's storage: valid until the
        next put or drop, so copy it out at once."""

    @abc.abstractmethod
    def drop(self, key: int) -> bool:
        """Forget `key` (True when it was held)."""

    @abc.abstractmethod
    def keys(self) -> list[int]:
        """Every key held, least recently used first."""

    @abc.abstractmethod
    def __contains__(self, key: int) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def touch(self, key: int) -> bool:
        """Mark `key` recently used; False when it is not held."""
        return key in self

    def close(self) -> None:  # noqa: B027 (an optional hook: backends with files or connections override it)
        """Release the storage (idempotent)."""

    # ---- shared -----------------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return len(self) * self.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.block_bytes

    def stats(self) -> dict[str, int]:
        return {"keys": len(self), "capacity": self.capacity, "hits": self.hits, "misses": self.misses,
                "puts": self.puts, "evictions": self.evictions, "corrupt": self.corrupt,
                "bytes_read": self.bytes_read, "bytes_written": self.bytes_written, "bytes_used": self.bytes_used}

    def _notify(self, key: int, stored: bool) -> None:
        if self.listener is not None:
            self.listener(key, stored)

    def _check(self, data: torch.Tensor) -> torch.Tensor:
        if data.dtype != torch.uint8 or data.numel() != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes of uint8, got {data.numel()} of {data.dtype}")
        return data.reshape(-1)


class _SlotTier(KVTier):
    """LRU bookkeeping over `capacity` numbered slots; subclasses read and write the slots."""

    def __init__(self, block_bytes: int, capacity: int) -> None:
        super().__init__(block_bytes, capacity)
        self._slots: OrderedDict[int, int] = OrderedDict()  # key → slot, least recently used first
        self._free: deque[int] = deque(range(capacity))

    @abc.abstractmethod
    def _write(self, slot: int, key: int, data: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def _read(self, slot: int, key: int) -> torch.Tensor | None:
        """The slot's bytes when they pass the check, else None."""

    def put(self, key: int, data: torch.Tensor) -> None:
        data = self._check(data)
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        if self._free:
            slot = self._free.popleft()
        else:
            old, slot = self._slots.popitem(last=False)
            self.evictions += 1
            self._notify(old, False)
        self._write(slot, key, data)
        self._slots[key] = slot
        self.puts += 1
        self.bytes_written += self.block_bytes
        self._notify(key, True)

    def get(self, key: int) -> torch.Tensor | None:
        slot = self._slots.get(key)
        if slot is None:
            self.misses += 1
            return None
        data = self._read(slot, key)
        if data is None:
            self.corrupt += 1
            logger.warning("KV tier: block %#x failed its digest check: dropped, it will be recomputed",
                           key & 0xFFFFFFFFFFFFFFFF)
            self.drop(key)
            return None
        self._slots.move_to_end(key)
        self.hits += 1
        self.bytes_read += self.block_bytes
        return data

    def touch(self, key: int) -> bool:
        if key not in self._slots:
            return False
        self._slots.move_to_end(key)
        return True

    def drop(self, key: int) -> bool:
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        self._free.append(slot)
        self._notify(key, False)
        return True

    def keys(self) -> list[int]:
        return list(self._slots)

    def __contains__(self, key: int) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)


class HostTier(_SlotTier):
    """Slots in host memory (pinned for a CUDA pool: copies to and from the device run at PCIe
    speed). Digests are kept beside the slots."""

    def __init__(self, block_bytes: int, capacity: int, *, pin_memory: bool = False) -> None:
        super().__init__(block_bytes, capacity)
        self.pinned = pin_memory and torch.cuda.is_available()
        self._store = torch.empty((capacity, block_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        self._digests: list[bytes | None] = [None] * capacity

    def _write(self, slot: int, key: int, data: torch.Tensor) -> None:
        dst = self._store[slot]
        dst.copy_(data)
        self._digests[slot] = _digest(key, _as_buffer(dst))

    def _read(self, slot: int, key: int) -> torch.Tensor | None:
        data = self._store[slot]
        return data if _digest(key, _as_buffer(data)) == self._digests[slot] else None

    def close(self) -> None:
        self._slots.clear()
        self._store = torch.empty((0, self.block_bytes), dtype=torch.uint8)


class DiskTier(_SlotTier):
    """Slots in one memory-mapped file under `directory` (a fresh subdirectory of it, or of the
    system's temp dir when None, removed on `close`). Slot = header (key, digest of (key, bytes))
    + the block's bytes at a 64-byte offset. The key → slot map is in memory: the file is this
    process's and does not outlive it.

    A process killed with -9 cannot remove its directory, so each tier holds a shared `flock` on
    its directory's `lock` file while it lives, and a new tier first removes every
    `pdserve-kv-tier-*` directory beside it whose lock nobody holds (`sweep_dead_tiers`)."""

    def __init__(self, block_bytes: int, capacity: int, directory: str | Path | None = None) -> None:
        super().__init__(block_bytes, capacity)
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        self.num_swept = sweep_dead_tiers(parent)
        self.directory = Path(tempfile.mkdtemp(prefix=TIER_DIR_PREFIX, dir=parent))
        self.path = self.directory / "blocks.bin"
        self.slot_bytes = _HEADER + block_bytes
        self._lock = open(self.directory / "lock", "w")  # held (shared) while this tier lives
        fcntl.flock(self._lock, fcntl.LOCK_SH)
        self._finalizer = weakref.finalize(self, _remove_tier, str(self.directory), self._lock)
        try:
            size = capacity * self.slot_bytes
            with open(self.path, "wb") as f:
                try:  # the disk reserved now: a full disk fails here, not as a SIGBUS on a write
                    os.posix_fallocate(f.fileno(), 0, size)
                except OSError as e:
                    if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    f.truncate(size)
            self._file = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
            self._file = self._file.view(capacity, self.slot_bytes)
        except BaseException:
            self.close()
            raise

    def _write(self, slot: int, key: int, data: torch.Tensor) -> None:
        row = self._file[slot]
        body = row[_HEADER:]
        body.copy_(data)
        header = _KEY.pack(key) + _digest(key, _as_buffer(body))
        row[: len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))

    def _read(self, slot: int, key: int) -> torch.Tensor | None:
        row = self._file[slot]
        header = bytes(_as_buffer(row[: _KEY.size + DIGEST_SIZE]))
        body = row[_HEADER:]
        if _KEY.unpack_from(header)[0] != key or header[_KEY.size:] != _digest(key, _as_buffer(body)):
            return None
        return body

    def slot_offset(self, key: int) -> int | None:
        """Where `key`'s bytes start in the file (tests corrupt them there)."""
        slot = self._slots.get(key)
        return None if slot is None else slot * self.slot_bytes + _HEADER

    def close(self) -> None:
        """Forget every key and delete the file and its directory (idempotent)."""
        self._slots.clear()
        self._free = deque(range(self.capacity))
        self._file = None
        self._finalizer()


TIER_DIR_PREFIX = "pdserve-kv-tier-"


def _remove_tier(directory: str, lock) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    lock.close()


def sweep_dead_tiers(parent: Path, min_age_s: float = 5.0) -> int:
    """Remove the disk tiers under `parent` whose process is gone (nobody holds their lock);
    returns how many. One younger than `min_age_s` may be a tier being created (its lock not
    taken yet): left alone."""
    removed = 0
    now = time.time()
    for directory in parent.glob(TIER_DIR_PREFIX + "*"):
        lock_path = directory / "lock"
        try:
            if now - directory.stat().st_mtime < min_age_s:
                continue
            with open(lock_path) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a live tier holds it
                shutil.rmtree(directory, ignore_errors=True)
                removed += 1
        except OSError:
            continue
    return removed


def make_tier(kind: str, block_bytes: int, capacity_gb: float, *, directory: str | Path | None = None,
              pin_memory: bool = False) -> KVTier | None:
    """The tier of --kv-offload (none | host | disk) holding `capacity_gb` GiB of blocks."""
    if kind == "none":
        return None
    capacity = int(capacity_gb * _GIB // block_bytes)
    if capacity < 1:
        raise ValueError(f"kv_offload_gb={capacity_gb} holds no block of {block_bytes} bytes")
    if kind == "host":
        return HostTier(block_bytes, capacity, pin_memory=pin_memory)
    if kind == "disk":
        return DiskTier(block_bytes, capacity, directory)
    raise ValueError(f"kv_offload must be one of none, host, disk; got {kind!r}")


class BlockTier:
    """A tier bound to the KV pools: what the block manager calls with block ids. `pools` are the
    [layers, 2, blocks, ...] buffers whose block `i` together make block i's bytes (the target's
    pool, and a draft model's when there is one). Copies are synchronous."""

    def __init__(self, tier: KVTier, pools: list[torch.Tensor]) -> None:
        self.tier = tier
        self.pools = pools
        self._sizes = self.block_sizes(pools)
        if sum(self._sizes) != tier.block_bytes:
            raise ValueError(f"the pools' blocks are {sum(self._sizes)} bytes, the tier's {tier.block_bytes}")

    @staticmethod
    def block_sizes(pools: list[torch.Tensor]) -> list[int]:
        """Bytes of one block in each pool."""
        return [p[:, :, 0].numel() * p.element_size() for p in pools]

    @classmethod
    def block_bytes(cls, pools: list[torch.Tensor]) -> int:
        return sum(cls.block_sizes(pools))

    def offload(self, key: int, block_id: int) -> None:
        """Copy block `block_id` into the tier under `key` (before the block is overwritten)."""
        if self.tier.touch(key):  # held already (equal keys, equal bytes): refreshed, nothing written
            return
        parts = [p[:, :, block_id].contiguous().view(-1).view(torch.uint8) for p in self.pools]
        self.tier.put(key, parts[0] if len(parts) == 1 else torch.cat([t.cpu() for t in parts]))

    def load(self, key: int, block_id: int) -> bool:
        """Copy `key`'s verified bytes into block `block_id`; False on a miss or a failed check."""
        data = self.tier.get(key)
        if data is None:
            return False
        offset = 0
        for pool, size in zip(self.pools, self._sizes):
            dst = pool[:, :, block_id]
            src = data[offset : offset + size].view(pool.dtype).view(dst.shape)
            dst.copy_(src)  # synchronous: the slot may be reused by the next put
            offset += size
        return True

    def touch(self, key: int) -> bool:
        return self.tier.touch(key)

    def __contains__(self, key: int) -> bool:
        return key in self.tier

    def keys(self) -> list[int]:
        return self.tier.keys()

    @property
    def listener(self) -> Callable[[int, bool], None] | None:
        return self.tier.listener

    @listener.setter
    def listener(self, fn: Callable[[int, bool], None] | None) -> None:
        self.tier.listener = fn

    def close(self) -> None:
        self.tier.close()
