"""A load client for benchmarks/router_capacity.py that costs the router's benchmark as little CPU
as possible: plain non-blocking sockets and one epoll loop, no HTTP library, no JSON parsing of
events. Each of `concurrency` slots sends one completion request at a time over its own connection
(`Connection: close`), and counts the tokens of what comes back:

    streamed       every event's "token_ids" (asked for with return_token_ids), found with one
                   regex over each read; the gap between reads that carried tokens is the
                   inter-token gap a user sees (kept as a 1 ms histogram, so a 5-minute run
                   holds no per-token list)
    not streamed   usage.completion_tokens of the one body
    429            counted; the slot waits the Retry-After seconds, then tries again

`cpu_s` (the process's CPU time) is what says whether the client could have been the bottleneck.
"""

from __future__ import annotations

import errno
import json
import re
import selectors
import socket
import time
from dataclasses import dataclass, field

_IDS = re.compile(rb'"token_ids": \[([0-9, ]*)\]')
_GAP_BUCKETS = 10_001  # 1 ms buckets, the last one holds everything from 10 s on


@dataclass
class ClientStats:
    tokens: int = 0
    requests_done: int = 0
    refused_429: int = 0
    errors: int = 0  # any other status, or a connection that ended early
    gaps_ms: list[int] = field(default_factory=lambda: [0] * _GAP_BUCKETS)

    def gap_quantile_s(self, q: float) -> float:
        total = sum(self.gaps_ms)
        if not total:
            return 0.0
        seen = 0
        for ms, count in enumerate(self.gaps_ms):
            seen += count
            if seen >= q * total:
                return ms / 1000
        return (_GAP_BUCKETS - 1) / 1000


class _Slot:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.sock: socket.socket | None = None
        self.buf = b""  # response bytes not yet scanned (a partial event)
        self.status: int | None = None
        self.last_tokens_at: float | None = None
        self.wait_until = 0.0  # after a 429


class LoadClient:
    def __init__(self, host: str, port: int, *, model: str, prompt_token_ids: list[int], max_tokens: int,
                 stream: bool) -> None:
        self.addr = (host, port)
        self.stream = stream
        payload = {"model": model, "prompt": prompt_token_ids, "max_tokens": max_tokens, "stream": stream,
                   "ignore_eos": True, "return_token_ids": True}
        data = json.dumps(payload).encode()
        self.request = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data
        self.stats = ClientStats()

    def run(self, concurrency: int, duration_s: float, measure_from_s: float = 0.0, on_tick=None,
            ramp_s: float = 0.0) -> ClientStats:
        """Keep `concurrency` requests going for `duration_s`, the slots starting evenly over
        `ramp_s`; only what arrives after `measure_from_s` counts (a warm-up). Returns the stats
        of the measured part. `on_tick` runs about once a second."""
        sel = selectors.EpollSelector()
        slots = [_Slot(self.request) for _ in range(concurrency)]
        start = time.monotonic()
        for i, slot in enumerate(slots):
            slot.wait_until = start + ramp_s * i / concurrency
        measure_at, end = start + measure_from_s, start + duration_s
        warm = ClientStats()
        next_tick = start
        try:
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if on_tick is not None and now >= next_tick:
                    on_tick()
                    next_tick += 1.0
                if now >= measure_at and warm is not None:
                    warm, self.stats = None, ClientStats()
                for slot in slots:
                    if slot.sock is None and now >= slot.wait_until:
                        self._open(sel, slot)
                for key, _ in sel.select(timeout=0.01):
                    self._read(sel, key.data, time.monotonic())
        finally:
            for slot in slots:
                self._close(sel, slot)
            sel.close()
        return self.stats

    def _open(self, sel: selectors.BaseSelector, slot: _Slot) -> None:
        sock = socket.create_connection(self.addr)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(slot.body)
        sock.setblocking(False)
        slot.sock, slot.buf, slot.status, slot.last_tokens_at = sock, b"", None, None
        sel.register(sock, selectors.EVENT_READ, slot)

    def _close(self, sel: selectors.BaseSelector, slot: _Slot) -> None:
        if slot.sock is not None:
            sel.unregister(slot.sock)
            slot.sock.close()
            slot.sock = None

    def _read(self, sel: selectors.BaseSelector, slot: _Slot, now: float) -> None:
        try:
            data = slot.sock.recv(1 << 16)
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return
            data = b""
        buf = slot.buf + data
        if slot.status is None:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                slot.buf = buf
                if not data:
                    self._ended(sel, slot, ok=False)
                return
            head, buf = buf[:head_end], buf[head_end + 4:]
            slot.status = int(head.split(b" ", 2)[1])
            if slot.status == 429:
                retry = re.search(rb"(?i)retry-after: *([0-9.]+)", head)
                slot.wait_until = now + (float(retry.group(1)) if retry else 1.0)
                self.stats.refused_429 += 1
                self._close(sel, slot)
                return
        if self.stream:
            cut = buf.rfind(b"\n\n") + 2  # events up to here are whole
            whole, slot.buf = buf[:cut], buf[cut:]
            if b'data: {"error"' in whole:
                self.stats.errors += 1
            num = sum(m.count(b",") + 1 for m in _IDS.findall(whole) if m)
            if num:
                stats = self.stats
                stats.tokens += num
                if slot.last_tokens_at is not None:
                    stats.gaps_ms[min(int((now - slot.last_tokens_at) * 1000), _GAP_BUCKETS - 1)] += 1
                slot.last_tokens_at = now
        else:
            slot.buf = buf
        if not data:
            self._ended(sel, slot, ok=slot.status == 200)

    def _ended(self, sel: selectors.BaseSelector, slot: _Slot, ok: bool) -> None:
        if ok and not self.stream:
            match = re.search(rb'"completion_tokens": *([0-9]+)', slot.buf)
            ok = match is not None
            if ok:
                self.stats.tokens += int(match.group(1))
        if ok:
            self.stats.requests_done += 1
        else:
            self.stats.errors += 1
        self._close(sel, slot)
