"""Leases: how long a prefill node keeps a handed-off request's blocks pinned.

A lease is a deadline per request. It ends in exactly one of three ways, and each ends with one
call of the `release` callback (which frees the request's blocks on the prefill node):

    hold ──renew──▶ hold ──release()──▶ released      (KVDone, abort, refused handshake)
                      └────expire()───▶ released      (the decode node went quiet)

`overdue()` lists the leases past their deadline without releasing them, for a caller that has
something to do first (the KV sender reports the failure while the request is still held).
Releasing twice is impossible: a released request is no longer held, and `release()` on a request
that is not held returns False without calling back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_LEASE_S = 30.0


@dataclass
class _Lease:
    lease_s: float
    deadline: float


class LeaseTable:
    def __init__(self, release: Callable[[str], None], default_s: float = DEFAULT_LEASE_S,
                 clock: Callable[[], float] = time.monotonic):
        if default_s <= 0:
            raise ValueError(f"lease must be positive, got {default_s}")
        self._release = release
        self.default_s = default_s
        self.clock = clock
        self._leases: dict[str, _Lease] = {}

    def hold(self, request_id: str, lease_s: float | None = None) -> None:
        """Pin a request's blocks until now + lease_s (the default when None or not positive)."""
        if request_id in self._leases:
            raise ValueError(f"request {request_id!r} is already held")
        lease_s = lease_s if lease_s and lease_s > 0 else self.default_s
        self._leases[request_id] = _Lease(lease_s, self.clock() + lease_s)

    def renew(self, request_id: str) -> bool:
        """Push the deadline to now + the request's lease; False if it is not held."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        lease.deadline = self.clock() + lease.lease_s
        return True

    def release(self, request_id: str) -> bool:
        """End the lease now and call back; False (and no call) if the request is not held."""
        if self._leases.pop(request_id, None) is None:
            return False
        self._release(request_id)
        return True

    def overdue(self) -> list[str]:
        """The requests whose lease is past its deadline (still held: the caller releases them)."""
        now = self.clock()
        return [rid for rid, lease in self._leases.items() if lease.deadline <= now]

    def expire(self) -> list[str]:
        """Release every lease past its deadline; returns their request ids."""
        overdue = self.overdue()
        for rid in overdue:
            self.release(rid)
        return overdue

    def deadline(self, request_id: str) -> float | None:
        lease = self._leases.get(request_id)
        return None if lease is None else lease.deadline

    @property
    def held_ids(self) -> list[str]:
        return list(self._leases)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases
