"""A node's link to the router: sends never block (a dead router costs dropped messages, not a
hung node), Reregister is answered in poll, and SIGTERM drains before deregistering."""

from __future__ import annotations

import time

import zmq

from pdserve.node.router_link import RouterLink
from pdserve.node.runtime import serve_node
from pdserve.protocol.messages import Abort, Deregister, Register, Reregister, decode
from pdserve.protocol.sockets import endpoint, make_socket


def register_msg() -> Register:
    return Register(node_id="n0", role="decode", model="tiny", pid=1)


class SmallQueueLink(RouterLink):
    SEND_HWM = 5


def test_sends_to_a_dead_router_are_dropped_not_blocking():
    link = SmallQueueLink("tcp://127.0.0.1:1", register_msg())  # nothing listens there
    try:
        start = time.monotonic()
        results = [link.send(Abort(f"r{i}")) for i in range(50)]
        assert time.monotonic() - start < 2.0
        assert not all(results) and link.num_dropped == results.count(False) > 0
    finally:
        link.close()


def test_reregister_is_answered_in_poll_and_other_messages_pass():
    router = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0")
    link = RouterLink(endpoint(router), register_msg(), heartbeat_s=60)
    try:
        link.register()
        identity, frame = router.recv_multipart()
        assert identity == b"n0" and isinstance(decode(frame), Register)
        router.send_multipart([identity, Reregister("unknown node").encode()])
        router.send_multipart([identity, Abort("r1").encode()])
        router.send_multipart([identity, b"garbage"])
        got = []
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            got = link.poll(50)
        assert [type(m) for m in got] == [Abort] and link.num_reregistered == 1
        assert router.poll(2000) and isinstance(decode(router.recv_multipart()[1]), Register)
    finally:
        link.close()
        router.close(0)


class FakeLink:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.register_msg = register_msg()

    def register(self) -> None:
        self.calls.append("register")

    def deregister(self) -> None:
        self.calls.append("deregister")


class FakeNode:
    def __init__(self, busy_steps: int) -> None:
        self.busy_steps, self.draining, self.steps_while_draining = busy_steps, False, 0

    def run_once(self) -> None:
        if self.draining:
            self.steps_while_draining += 1
            self.busy_steps -= 1

    def is_idle(self) -> bool:
        return self.busy_steps <= 0


def test_sigterm_drains_then_deregisters():
    node, link = FakeNode(busy_steps=5), FakeLink()
    serve_node(node, link, stop_flag=[True])
    assert node.draining and node.steps_while_draining == 5  # kept working until idle
    assert link.calls == ["register", "deregister"]


def test_drain_gives_up_after_the_timeout():
    node, link = FakeNode(busy_steps=10**9), FakeLink()
    start = time.monotonic()
    serve_node(node, link, stop_flag=[True], drain_timeout_s=0.2)
    assert 0.2 <= time.monotonic() - start < 2 and link.calls == ["register", "deregister"]


def test_deregister_message_is_sent_once():
    router = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0")
    link = RouterLink(endpoint(router), register_msg(), heartbeat_s=60)
    try:
        link.register()
        link.deregister()
        link.deregister()
        msgs = []
        while router.poll(500):
            msgs.append(decode(router.recv_multipart()[1]))
        assert [type(m) for m in msgs] == [Register, Deregister]
    finally:
        link.close()
        router.close(0)
