"""The decode node asks its scheduler what to pull and only talks to the receiver: admission
when blocks allow, lease renewals while it waits, done, failed and aborted transfers, and the
pull-delay fault. A fake receiver stands in for KVReceiver; the engine is the tiny model."""

from __future__ import annotations

import time

import pytest
import zmq

from pdserve.engine.request import RequestStatus
from pdserve.kvtransfer.receiver import KVEvent, KVEventKind
from pdserve.node.faults import FaultInjection
from pdserve.node.requests import Stage
from pdserve.node.router_link import RouterLink
from pdserve.protocol.messages import Abort, Error, KVReady, decode
from tests.kvtransfer.test_node_metrics import make_engine

GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


class FakeReceiver:
    """Records the node's calls; `events` are handed out by the next poll()."""

    num_shm_copies = num_zmq_pulls = 0
    auth_refusals = None  # no CURVE socket

    @property
    def num_bytes_received(self) -> int:  # as KVReceiver: the bytes of every DONE handed out
        return self.num_bytes_done

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.num_bytes_done = 0
        self.pulls: list[tuple[str, list[int]]] = []
        self.first_blocks: dict[str, int] = {}  # request id → the first block pulled (the ones before: cached)
        self.renewed: list[str] = []
        self.released: list[tuple[str, str]] = []

    def poll(self, timeout_ms: int = 0) -> list[KVEvent]:
        events, self.events = self.events, []
        self.num_bytes_done += sum(e.num_bytes for e in events if e.kind is KVEventKind.DONE)
        return events

    def pull(self, request_id: str, block_ids: list[int], first_block: int = 0) -> None:
        self.pulls.append((request_id, block_ids))
        self.first_blocks[request_id] = first_block

    def renew(self, request_id: str) -> None:
        self.renewed.append(request_id)

    def release(self, request_id: str, error: str = "") -> None:
        self.released.append((request_id, error))


@pytest.fixture
def router():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(0)


def make_node(tiny_llama, addr, **kw):
    from pdserve.decode_node.node import DecodeNode
    from pdserve.node.engine_wire import register_message

    engine = make_engine(tiny_llama)
    receiver = FakeReceiver()
    node = DecodeNode(engine, RouterLink(addr, register_message("d0", "decode", engine, "tiny")), receiver, **kw)
    return node, receiver


def ready(request_id: str, num_tokens: int = 17) -> KVEvent:
    msg = KVReady(request_id, list(range(3, 3 + num_tokens)), 5, None, GREEDY, num_tokens, [0, 1], 16, 30.0)
    return KVEvent(KVEventKind.READY, request_id, msg)


def errors_from(sock) -> list[Error]:
    out = []
    while sock.poll(500):
        msg = decode(sock.recv_multipart()[1])
        if isinstance(msg, Error):
            out.append(msg)
    return out


def test_pull_done_decode(tiny_llama, router, no_leak):
    node, receiver = make_node(tiny_llama, router[1])
    sched = node.engine.scheduler
    try:
        receiver.events = [ready("r1")]
        node.run_once()
        assert [rid for rid, _ in receiver.pulls] == ["r1"]  # room at once: pulled into its blocks
        assert receiver.pulls[0][1] == sched.block_manager.block_ids("r1")
        assert sched.requests["r1"].status is RequestStatus.RECEIVING_KV and not node.is_idle()
        assert node.heartbeat().request_ids == ["r1"] and node.status()["num_receiving"] == 1
        receiver.events = [KVEvent(KVEventKind.DONE, "r1", num_bytes=4096)]
        while not node.is_idle():
            node.run_once()
        assert node.requests.recent[-1]["request_id"] == "r1" and "kv_done" in node.requests.recent[-1]
        assert node.num_kv_bytes_received > 0
    finally:
        node.link.close()
    no_leak(node.engine.block_manager)


def test_waits_for_blocks_renews_its_lease_then_fails(tiny_llama, router, no_leak, monkeypatch):
    node, receiver = make_node(tiny_llama, router[1])
    sched, bm = node.engine.scheduler, node.engine.block_manager
    try:
        hog = bm.allocate("hog", bm.num_blocks * bm.block_size)  # the pool is full
        assert len(hog) == bm.num_blocks
        receiver.events = [ready("r1")]
        node.run_once()
        assert receiver.pulls == [] and sched.requests["r1"].status is RequestStatus.WAITING_FOR_KV
        assert node.heartbeat().num_waiting == 1 and node.metrics_snapshot().num_waiting == 1
        node.run_once()
        assert receiver.renewed == []  # renewed only every 5 s
        sched.requests["r1"].kv_lease_renewed_at -= 6
        node.run_once()
        assert receiver.renewed == ["r1"]
        bm.free("hog")
        node.run_once()
        assert [rid for rid, _ in receiver.pulls] == ["r1"] and bm.num_used_blocks > 0
        receiver.events = [KVEvent(KVEventKind.FAILED, "r1", error="no data")]
        node.run_once()
        assert node.is_idle() and bm.num_used_blocks == 0 and not node.engine.has_unfinished()
        errors = errors_from(router[0])
        assert [(e.request_id, e.retryable) for e in errors] == [("r1", True)] and "no data" in errors[0].message
    finally:
        node.link.close()
    no_leak(bm)


@pytest.mark.parametrize("pulled", [False, True])
def test_abort_while_waiting_or_receiving_releases(tiny_llama, router, no_leak, pulled):
    node, receiver = make_node(tiny_llama, router[1])
    bm = node.engine.block_manager
    try:
        if not pulled:
            bm.allocate("hog", bm.num_blocks * bm.block_size)
        receiver.events = [ready("r1")]
        node.run_once()
        assert bool(receiver.pulls) == pulled
        assert node.requests.stage("r1") is (Stage.RECEIVING_KV if pulled else Stage.WAITING_FOR_KV)
        node.handle(Abort("r1"))
        assert receiver.released == [("r1", "aborted")] and node.engine.scheduler.requests == {}
        assert "r1" not in node.requests
        bm.free("hog")
        receiver.events = [KVEvent(KVEventKind.DONE, "r1", num_bytes=4096)]  # a late DONE is ignored
        node.run_once()
        assert node.is_idle()
    finally:
        node.link.close()
    no_leak(bm)


def test_pull_delay_fault_holds_the_pull_back(tiny_llama, router, no_leak):
    node, receiver = make_node(tiny_llama, router[1], faults=FaultInjection(kv_pull_delay_s=0.3))
    try:
        receiver.events = [ready("r1")]
        node.run_once()
        assert receiver.pulls == []
        time.sleep(0.35)
        node.run_once()
        assert [rid for rid, _ in receiver.pulls] == ["r1"]
        node.abort("r1")
    finally:
        node.link.close()
    no_leak(node.engine.block_manager)
