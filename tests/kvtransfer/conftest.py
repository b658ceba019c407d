"""Factories for the KV transfer tests: tiny layouts and pools, a fake clock, a release log, a fake
fault injector, a pump that drives a sender and a receiver until a condition holds, and socket
calls that never block past a deadline (a raw `send` on a DEALER whose CURVE handshake failed
would block forever)."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
import zmq

from pdserve.kvcache.shm_pool import SharedKVPool
from pdserve.kvtransfer.layout import layout_shape
from pdserve.kvtransfer.payload import DTYPES
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.protocol.messages import KVLayout, KVRank, KVReady, Message
from pdserve.protocol.sockets import recv_msg

TEST_DTYPES = ["float32", "bfloat16"]


def make_layout(*, block_size: int = 16, num_blocks: int = 16, dtype: str = "float32", num_layers: int = 2,
                num_kv_heads: int = 2, head_dim: int = 16, model: str = "tiny", ranks: list[KVRank] | None = None,
                **rank_kw) -> KVLayout:
    """A layout without tensor parallelism unless `ranks` says otherwise: one rank holding every
    head, its same-host fields (shm_name, probe_token...) from `rank_kw`."""
    ranks = ranks if ranks is not None else [KVRank(0, num_kv_heads, **rank_kw)]
    return KVLayout(model=model, dtype=dtype, num_layers=num_layers, num_kv_heads=num_kv_heads,
                    head_dim=head_dim, block_size=block_size, num_blocks=num_blocks, tp_size=len(ranks), ranks=ranks)


def make_pool(layout: KVLayout, *, seed: int | None = 0) -> torch.Tensor:
    """A pool of random values (seed) or zeros (seed=None)."""
    shape = layout_shape(layout)
    if seed is None:
        return torch.zeros(shape, dtype=DTYPES[layout.dtype])
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(DTYPES[layout.dtype])


def make_ready(request_id: str, block_ids: list[int], num_tokens: int, block_size: int,
               lease_s: float = 30.0) -> KVReady:
    return KVReady(request_id=request_id, prompt_token_ids=list(range(num_tokens)), first_token=7,
                   first_logprobs=None, sampling={"max_tokens": 4}, num_tokens=num_tokens,
                   block_ids=list(block_ids), block_size=block_size, lease_s=lease_s)


def reference_tokens(pool: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """[layers, 2, num_tokens, heads, head_dim] the slow, obvious way (one token at a time)."""
    block_size = pool.shape[3]
    return torch.stack([pool[:, :, block_ids[t // block_size], t % block_size] for t in range(num_tokens)], dim=2)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class EveryNthPull:
    """Stands in for the node's FaultInjection: "drop" answers every Nth pull with nothing,
    "corrupt" sends every Nth payload one byte short."""

    def __init__(self, kind: str, every: int = 1):
        self.kind, self.every, self.num_pulls = kind, every, 0

    def spoil_payload(self, frame: memoryview) -> memoryview | None:
        self.num_pulls += 1
        if self.num_pulls % self.every:
            return frame
        return None if self.kind == "drop" else memoryview(frame).cast("B")[:-1]


# ---- bounded socket calls ---------------------------------------------------------------------
WAIT_S = 3.0


def send_within(sock: zmq.Socket, *frames, timeout_s: float = WAIT_S) -> bool:
    """Send one multipart message without blocking: NOBLOCK, retried while the queue is full or no
    peer is attached yet; False if it still could not go after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.send_multipart([f.encode() if isinstance(f, Message) else f for f in frames], zmq.NOBLOCK)
            return True
        except zmq.Again:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)


def recv_within(sock: zmq.Socket, timeout_s: float = WAIT_S) -> list[bytes]:
    """The next multipart message; fails the test if none arrives within `timeout_s`."""
    assert sock.poll(int(timeout_s * 1000)), "nothing arrived"
    return sock.recv_multipart(zmq.NOBLOCK)


def recv_msg_within(sock: zmq.Socket, timeout_s: float = WAIT_S) -> Message:
    """The next decoded message (protocol.sockets.recv_msg) within `timeout_s`."""
    assert sock.poll(int(timeout_s * 1000)), "nothing arrived"
    return recv_msg(sock, zmq.NOBLOCK)[1]


class ReleaseLog:
    """The prefill node's release callback, counting calls per request."""

    def __init__(self):
        self.calls: list[str] = []

    def __call__(self, request_id: str) -> None:
        self.calls.append(request_id)

    def assert_released_once(self, request_ids) -> None:
        counts = Counter(self.calls)
        assert counts == Counter(set(request_ids)), f"release calls {dict(counts)}, expected each of {request_ids} once"


def pump(sender: KVSender, receiver: KVReceiver, until, timeout_s: float = 5.0) -> list:
    """Poll both ends until `until(events_so_far)` is true; returns every receiver event."""
    events: list = []
    deadline = time.monotonic() + timeout_s
    while not until(events):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; events so far: {events}")
        sender.poll(1)
        events.extend(receiver.poll(1))
    return events


def kinds(events, kind: str) -> list[str]:
    return [e.request_id for e in events if e.kind == kind]


@pytest.fixture
def closing():
    """Register things with a close() method; closed at the end of the test."""
    things = []
    yield things.append
    for thing in reversed(things):
        thing.close()


@pytest.fixture
def shm_pool_factory(closing):
    def create(layout: KVLayout, *, seed: int = 0) -> SharedKVPool:
        pool = SharedKVPool.create("test", layout_shape(layout), DTYPES[layout.dtype])
        closing(pool)
        pool.tensor.copy_(make_pool(layout, seed=seed))
        return pool
    return create


# ---- a sender and a receiver wired together over tcp loopback ----------------------------------
class Pair:
    def __init__(self, sender: KVSender, receiver: KVReceiver, released: ReleaseLog, errors: list):
        self.sender, self.receiver, self.released, self.errors = sender, receiver, released, errors
        self.src, self.dst = sender.kv_buffer, receiver.kv_buffer

    def send(self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float = 30.0) -> None:
        ready = make_ready(request_id, block_ids, num_tokens, self.sender.layout.block_size, lease_s)
        self.sender.send("d0", self.receiver.kv_addr, ready)

    def pump(self, until, timeout_s: float = 5.0) -> list:
        return pump(self.sender, self.receiver, until, timeout_s)

    def transfer(self, request_id: str, src_ids: list[int], dst_ids: list[int], num_tokens: int) -> list:
        """send → ready → pull → done (or failed); returns the receiver's events."""
        self.send(request_id, src_ids, num_tokens)
        events = self.pump(lambda ev: request_id in kinds(ev, "ready"))
        self.receiver.pull(request_id, dst_ids)
        return events + self.pump(lambda ev: request_id in kinds(ev, "done") + kinds(ev, "failed"))


@pytest.fixture
def make_pair(closing, shm_pool_factory):
    def make(*, src_bs: int = 16, dst_bs: int = 16, dtype: str = "float32", shm: bool = False, clock=None,
             sender_layout: dict | None = None, pull_timeout_s: float = 30.0, faults=None, **receiver_kw) -> Pair:
        src_layout = make_layout(**{"block_size": src_bs, "dtype": dtype, **(sender_layout or {})})
        pool = shm_pool_factory(src_layout) if shm else None
        src = pool.tensor if shm else make_pool(src_layout)
        released, errors = ReleaseLog(), []
        kw = {} if clock is None else {"clock": clock}
        sender = KVSender("p0", src_layout, src, released, shm_pool=pool, faults=faults,
                          on_error=lambda rid, msg: errors.append((rid, msg)), **kw)
        dst_layout = make_layout(block_size=dst_bs, dtype=dtype)
        receiver = KVReceiver("d0", dst_layout, make_pool(dst_layout, seed=None), pull_timeout_s=pull_timeout_s,
                              **receiver_kw, **kw)
        closing(receiver)
        closing(sender)  # closed first (reverse order)
        return Pair(sender, receiver, released, errors)
    return make
