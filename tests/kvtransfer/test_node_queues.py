"""Bounded node queues: past --max-queue-len a prefill node refuses new requests and a decode node
refuses announced KV, each with a retryable Error to the router, holding no block for them."""

from __future__ import annotations

import time

import zmq

from pdserve.node.router_link import RouterLink
from pdserve.protocol.messages import Error, PrefillRequest, decode
from tests.kvtransfer.test_node_metrics import make_engine

GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}


def router_socket():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def errors_from(sock, timeout_s: float = 5.0) -> list[Error]:
    out, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline and sock.poll(200):
        msg = decode(sock.recv_multipart()[1])
        if isinstance(msg, Error):
            out.append(msg)
    return out


def test_prefill_queue_limit(tiny_llama, no_leak):
    from pdserve.node.engine_wire import register_message
    from pdserve.prefill_node.node import PrefillNode

    router, addr = router_socket()
    engine = make_engine(tiny_llama)
    node = PrefillNode(engine, RouterLink(addr, register_message("p0", "both", engine, "tiny")), role="both",
                       max_queue_len=2)
    try:
        for i in range(4):  # nothing runs between them: 2 wait, 2 are refused
            node.handle(PrefillRequest(f"r{i}", list(range(3, 20)), GREEDY))
        errors = errors_from(router)
        assert [(e.request_id, e.retryable) for e in errors] == [("r2", True), ("r3", True)]
        assert "queue full" in errors[0].message and set(engine.scheduler.requests) == {"r0", "r1"}
        assert node.requests.held_ids() == ["r0", "r1"] and len(node.requests) == 2  # the refused ones forgotten
        while engine.has_unfinished():
            node.run_once()
    finally:
        node.link.close()
        router.close(0)
    no_leak(engine.block_manager)


def test_decode_queue_limit(tiny_llama, no_leak):
    from pdserve.decode_node.node import DecodeNode
    from pdserve.node.engine_wire import kv_layout, register_message
    from pdserve.protocol.messages import KVReady

    router, addr = router_socket()
    engine = make_engine(tiny_llama)
    released = []

    class Receiver:  # stands in for KVReceiver: records what the node gives up
        num_shm_copies = num_zmq_pulls = num_bytes_received = 0
        auth_refusals = None  # no CURVE socket

        def release(self, request_id, error=""):
            released.append((request_id, error))

    node = DecodeNode(engine, RouterLink(addr, register_message("d0", "decode", engine, "tiny")), Receiver(),
                      max_queue_len=1)
    layout = kv_layout(engine, "tiny")
    try:
        for i in range(3):
            node._on_ready(KVReady(f"r{i}", list(range(3, 20)), 5, None, GREEDY, 17, [0, 1], layout.block_size, 30.0))
        assert [r.request_id for r in engine.scheduler.waiting_for_kv] == ["r0"]
        assert [rid for rid, _ in released] == ["r1", "r2"] and "queue full" in released[0][1]
        assert [e.request_id for e in errors_from(router)] == ["r1", "r2"]
        assert engine.block_manager.num_used_blocks == 0 and node.requests.held_ids() == ["r0"]
    finally:
        node.link.close()
        router.close(0)
