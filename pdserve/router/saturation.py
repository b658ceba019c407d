"""The router's own saturation, and when it sheds new work instead of stalling the streams it has.

One process runs the control loop (router/control.py: node messages, tokens) and every HTTP
handler (router/app.py: writing events to clients) on one event loop. When that loop has more to
do than it can, nothing fails: everything just runs later, and every stream's gaps grow together.
Two signals tell it early:

    loop lag         how late a timer fires (a probe sleeps PROBE_INTERVAL_S and measures the
                     overshoot); the HTTP side waits that long for its turn
    control backlog  how long the oldest node message read off the socket has waited for its
                     turn (ControlSocket.backlog_age_s); tokens reach clients that much later

Each probe samples both; the router counts as overloaded when every one of the last SUSTAINED
probes saw one of them past `max_lag_s` (a burst of new requests handled in one turn delays one
probe, not three), or when the loop has been stuck in one turn for STALL_S.

Lag is not load. On a shared machine a timer also fires late when other processes hold the
router's core, and shedding then turns clients away for a load the router does not have. So
each probe also measures the work the router actually did: the CPU seconds its event-loop thread
spent per wall second since the previous probe (`busy`). Lag only counts as overload while the
loop was busy at least BUSY_MIN of those probes' time; lag with an idle loop is co-tenant noise,
shown as `pdserve_router_event_loop_busy_ratio` and not shed.

When overloaded, new requests get a 429 with Retry-After (`admit`) and the number of requests in
flight becomes a limit: 90% of those in flight when the overload is first seen, lowered by 10%
once per DECREASE_EVERY_S while it lasts (requests end, the load falls, the backlog drains). Once
the loop has been calm for CALM_S the limit rises by 1% per probe (at least one request) until it
no longer binds. Requests already accepted are never shed: the point is that their streams keep
flowing.

The Retry-After of every 429 (this one's and the queue limit's, dispatcher.py) comes from
`RetryAfter`: a fixed value would send every waiting client back at the same moment, again and
again, and the router would spend its time answering 429s instead of streaming. It books the
crowd's retries in turn, at about twice the rate requests are admitted.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Callable

DEFAULT_MAX_LAG_S = 0.1  # a 429 once the loop or the control backlog is this late
PROBE_INTERVAL_S = 0.05
CALM_S = 1.0  # no overload for this long before the in-flight limit rises again
DECREASE_EVERY_S = 1.0  # the limit falls by 10% at most this often while the overload lasts
LAG_WINDOW_S = 1.0  # /metrics shows the worst lag of this window
SUSTAINED = 3  # probes in a row past max_lag_s make an overload
BUSY_MIN = 0.5  # ... while the loop's own thread was on the CPU this much of their time
STALL_S = 0.5  # or one turn of the loop this long (no probe has run for it)
RETRY_WINDOW_S = 5.0  # RetryAfter's rates are over this long
MAX_RETRY_AFTER_S = 30


class Saturation:
    def __init__(self, backlog_age_s: Callable[[], float], *, max_lag_s: float | None = DEFAULT_MAX_LAG_S,
                 on_lag: Callable[[float], None] = lambda lag: None) -> None:
        self.backlog_age_s = backlog_age_s
        self.max_lag_s = max_lag_s  # None: never shed
        self.on_lag = on_lag  # every probe's lag (the metrics' histogram)
        self.limit: float | None = None  # requests in flight allowed while recovering (None: no limit)
        self._probes: list[tuple[float, float, float]] = []  # (when, lag, backlog age) within LAG_WINDOW_S
        self._busy: list[float] = []  # per probe: the loop thread's CPU seconds per wall second (1.0: unknown)
        self._last_probe: float | None = None  # None: the probe is not running
        self._last_overload = -1e9
        self._last_decrease = -1e9

    def busy_ratio(self) -> float:
        """The loop thread's CPU share over the last SUSTAINED probes (0 before any)."""
        last = self._busy[-SUSTAINED:]
        return sum(last) / len(last) if last else 0.0

    def loop_lag_s(self) -> float:
        """The worst lag of the last LAG_WINDOW_S, or how overdue the next probe is if that is worse
        (a loop stuck in one long turn has no probe to show for it yet)."""
        now = time.monotonic()
        recent = max((lag for when, lag, _ in self._probes if now - when <= LAG_WINDOW_S), default=0.0)
        return max(recent, self._stalled_s(), 0.0)

    def _stalled_s(self) -> float:
        return time.monotonic() - self._last_probe - PROBE_INTERVAL_S if self._last_probe is not None else 0.0

    def overload(self) -> str | None:
        """Why the router is overloaded now ("loop_lag", "control_backlog"), or None."""
        limit = self.max_lag_s
        if limit is None:
            return None
        if self._stalled_s() > max(STALL_S, limit):
            return "loop_lag"
        last = self._probes[-SUSTAINED:]
        if len(last) < SUSTAINED:
            return None
        if sum(self._busy[-SUSTAINED:]) / SUSTAINED < BUSY_MIN:
            return None  # late, but not from the router's own work: others hold the core
        if all(lag > limit for _, lag, _ in last):
            return "loop_lag"
        if all(max(lag, age) > limit for _, lag, age in last):
            return "control_backlog"
        return None

    def admit(self, num_in_flight: int) -> str | None:
        """None to take a new request, else why not ("loop_lag", "control_backlog", "in_flight_limit")."""
        reason = self.overload()
        if reason is not None:
            now = self._last_overload = time.monotonic()
            if self.limit is None:
                self.limit, self._last_decrease = max(1.0, 0.9 * num_in_flight), now
            elif now - self._last_decrease >= DECREASE_EVERY_S:
                self.limit, self._last_decrease = max(1.0, 0.9 * min(self.limit, num_in_flight)), now
            return reason
        if self.limit is not None and num_in_flight >= self.limit:
            return "in_flight_limit"
        return None

    async def probe_loop(self) -> None:
        """Measure the loop's lag every PROBE_INTERVAL_S, until cancelled."""
        self._last_probe = time.monotonic()
        try:
            while True:
                before, cpu_before = time.monotonic(), time.thread_time()
                await asyncio.sleep(PROBE_INTERVAL_S)
                now = time.monotonic()
                busy = (time.thread_time() - cpu_before) / max(now - before, 1e-6)
                self.record(now, max(0.0, now - before - PROBE_INTERVAL_S), busy=min(1.0, busy))
        finally:
            self._last_probe = None

    def record(self, now: float, lag: float, *, busy: float = 1.0) -> None:
        """One probe: the loop ran its timer `lag` seconds late (monotonic `now`), its thread on
        the CPU `busy` of the time since the previous probe (1.0 when not measured)."""
        self._last_probe = now
        keep = [i for i, p in enumerate(self._probes) if now - p[0] <= LAG_WINDOW_S]
        self._probes = [self._probes[i] for i in keep]
        self._busy = [self._busy[i] for i in keep]
        self._probes.append((now, lag, self.backlog_age_s()))
        self._busy.append(busy)
        self.on_lag(lag)
        self._relax(now)

    def _relax(self, now: float) -> None:
        if self.limit is None or now - self._last_overload < CALM_S or self.overload() is not None:
            return
        self.limit += max(1.0, 0.01 * self.limit)
        if self.limit > 1e6:
            self.limit = None


class RetryAfter:
    """The Retry-After of a 429, in whole seconds (1 to `max_s`).

    Retries are booked like a queue: each rejected client is given the next free slot (the first
    one now, so at least 1 s), slots 1 / (2 A) apart, A being the rate new requests were admitted
    at over the last `window_s`. The crowd's retries come back at about twice the rate the servers
    take requests (enough to fill every slot that frees, without a storm of 429s) and in turn."""

    def __init__(self, *, window_s: float = RETRY_WINDOW_S, max_s: int = MAX_RETRY_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s, self.max_s, self.clock = window_s, max_s, clock
        self._admitted: collections.deque[float] = collections.deque()  # when, within window_s
        self._next = -math.inf  # the latest retry slot given

    def admitted(self) -> None:
        """A new request was taken."""
        now = self.clock()
        self._admitted.append(now)
        self._trim(now)

    def rejected(self) -> int:
        """A new request gets a 429: the Retry-After to tell it."""
        now = self.clock()
        self._trim(now)
        admitted = self._admitted
        span = min(max(now - admitted[0], 1.0), self.window_s) if admitted else self.window_s
        admit_rate = max(len(admitted), 1) / span
        slot = max(self._next, now)  # the first of a crowd gets the earliest: 1 s
        self._next = min(slot + 1 / (2 * admit_rate), now + self.max_s)
        return min(self.max_s, max(1, math.ceil(slot - now)))

    def _trim(self, now: float) -> None:
        while self._admitted and self._admitted[0] < now - self.window_s:
            self._admitted.popleft()
