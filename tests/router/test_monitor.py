"""The monitor judges a node's silence only up to what the router has handled: a heartbeat waiting
in the control backlog, or in the socket through a stall of the router's event loop, is not
silence."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from pdserve.protocol.messages import Heartbeat, Register
from pdserve.router.control import ControlSocket
from pdserve.router.monitor import Monitor
from pdserve.router.registry import Registry
from pdserve.router.request_table import RequestTable
from tests.router.fakes import FakeDispatcher, FakeRedispatcher, add_node, make_request

pytestmark = pytest.mark.timeout(30)


class Checks:
    """The monitor's expiry on a registry and a control socket; lost nodes are noted."""

    def __init__(self, registry: Registry, control: ControlSocket) -> None:
        self.lost = []
        self.monitor = Monitor(registry, control, RequestTable(registry), dispatcher=None, redispatcher=self,
                               lost_after_s=10.0)

    async def node_lost(self, node, reason: str) -> None:
        self.lost.append((node.node_id, reason))

    def expire(self) -> list:
        asyncio.run(self.monitor.expire_nodes())
        return self.lost


@pytest.fixture
def control():
    sock = ControlSocket("tcp://127.0.0.1:0")
    sock.open()
    yield sock
    sock.close()


def test_silence_is_judged_up_to_what_the_router_has_handled(control):
    now = time.monotonic()
    reg = Registry(heartbeat_timeout_s=1.5)
    reg.register(Register("d0", "decode", "m"), b"d0", now=now - 2.0)
    reg.heartbeat(Heartbeat("d0", 10, 10, 0, 0, ready=True), now=now - 2.0)  # handled 2 s ago
    checks = Checks(reg, control)
    control._caught_up_at = now - 1.0  # the socket was last found empty 1 s ago

    # Behind by a backlog: a message read just now, not handled yet, arrived after that.
    control.backlog.append(([], time.monotonic(), now - 1.0))
    assert checks.expire() == [] and list(reg.nodes) == ["d0"]  # known silence 1 s < 1.5 s
    control.backlog.clear()

    # A stall of the event loop: a message waits in the socket, nothing read it.
    peer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        peer.connect(control.addr)
        peer.send(b"heartbeat")
        deadline = time.monotonic() + 10
        while not control._shadow.get(zmq.EVENTS) & zmq.POLLIN:
            assert time.monotonic() < deadline, "the message never reached the router socket"
            time.sleep(0.01)
        assert checks.expire() == [] and list(reg.nodes) == ["d0"]

        # Caught up (the message read and handled) and still nothing from d0: silent for 2 s.
        control._shadow.recv_multipart()
        assert not control._shadow.get(zmq.EVENTS) & zmq.POLLIN
        assert checks.expire() == [("d0", "node d0 stopped responding")] and not reg.nodes
    finally:
        peer.close(linger=0)


def test_the_read_loop_stamps_what_it_reads_with_when_the_socket_was_last_empty(control):
    """recv_loop: each message in the backlog carries the last time the socket was found empty
    (the earliest it can have arrived), and known_until follows the oldest one not handled."""
    handled = []
    gate = asyncio.Event()

    async def handle(identity, msg, peer_key):
        handled.append(msg)
        await gate.wait()  # hold the first message: the rest stays in the backlog

    async def scenario():
        loop_task = asyncio.create_task(control.recv_loop(handle))
        await asyncio.sleep(0.05)
        before = time.monotonic()
        peer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            peer.connect(control.addr)
            for i in range(3):
                peer.send(Heartbeat(f"n{i}", 1, 1, 0, 0).encode())
            deadline = time.monotonic() + 10
            while len(control.backlog) < 2:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert len(handled) == 1
            # All arrived after the loop began waiting (before `before`), none was handled yet.
            assert all(since <= before for _, _, since in control.backlog)
            assert control.known_until() <= before
            gate.set()
            while control.backlog:
                await asyncio.sleep(0.01)
            assert len(handled) == 3 and control.known_until() >= before
        finally:
            loop_task.cancel()
            peer.close(linger=0)

    asyncio.run(scenario())


def test_peeking_at_the_socket_does_not_strand_a_waiting_receive(control):
    """known_until asks the socket whether messages wait; libzmq's FD is edge-triggered, so a peek
    that used up the edge would leave the read loop asleep on a message that has arrived."""
    handled = []

    async def handle(identity, msg, peer_key):
        handled.append(msg)

    async def scenario():
        loop_task = asyncio.create_task(control.recv_loop(handle))
        await asyncio.sleep(0.05)  # the loop waits on an empty socket
        peer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            peer.connect(control.addr)
            await asyncio.sleep(0.1)  # connected
            peer.send(Heartbeat("n0", 1, 1, 0, 0).encode())
            time.sleep(0.2)  # it arrives while the event loop is busy (blocked here)
            before = time.monotonic()
            assert control.known_until() <= before - 0.2  # waiting unread: the loop is behind
            deadline = time.monotonic() + 5
            while not handled:  # and the read loop still wakes for it, with no further message
                assert time.monotonic() < deadline, "the waiting receive was stranded"
                await asyncio.sleep(0.01)
            assert control.known_until() >= before
        finally:
            loop_task.cancel()
            peer.close(linger=0)

    asyncio.run(scenario())


def test_a_request_past_its_deadline_fails_and_one_no_node_lists_is_redispatched(tokenizer, control):
    """check_requests, with a fake dispatcher and re-dispatcher."""
    reg = Registry()
    add_node(reg, "b0", "both")
    table = RequestTable(reg)
    dispatcher, redispatcher = FakeDispatcher(table, reg), FakeRedispatcher()
    monitor = Monitor(reg, control, table, dispatcher, redispatcher, lost_after_s=2.0)
    late = make_request(tokenizer, "late", deadline=time.monotonic() - 1)
    lost = make_request(tokenizer, "lost")
    fine = make_request(tokenizer, "fine")
    for req in (late, lost, fine):
        asyncio.run(dispatcher.dispatch(req, dispatcher.reroute(req)))
    lost.last_listed = time.monotonic() - 10
    asyncio.run(monitor.check_requests())
    assert dispatcher.named("fail") == [("fail", "late", 504)]
    assert redispatcher.calls == [("redispatch", "lost", "no node has listed lost for 2 s")]


def test_each_check_expires_nodes_then_unparks_then_checks_requests(tokenizer, control):
    reg = Registry()
    table = RequestTable(reg)
    redispatcher = FakeRedispatcher()
    monitor = Monitor(reg, control, table, FakeDispatcher(table, reg), redispatcher, lost_after_s=2.0)
    asyncio.run(monitor.check())
    assert redispatcher.calls == []  # nothing parked: no unpark
    table.park(make_request(tokenizer, "p"), time.monotonic() + 30, "no node")
    asyncio.run(monitor.check())
    assert redispatcher.calls == [("unpark",)]
