"""The router's control socket (router/control.py): the bound address, the socket's limits, a bind
that fails, and CURVE: only nodes holding the cluster's keys can register."""

from __future__ import annotations

import asyncio
import re

import pytest
import zmq

from pdserve.protocol.curve import CurveKeys, apply_client, generate_keys
from pdserve.protocol.messages import MAX_MESSAGE_BYTES
from pdserve.router.control import ControlSocket
from pdserve.router.router import Router
from tests.router.conftest import MODEL, run, wait_until
from tests.router.fake_node import FakeNode


class CurveNode(FakeNode):
    """A fake node whose socket is a CURVE client with `keys` (None: plain), and whose connection's
    routing id may differ from the node id it claims (an impostor's)."""

    def __init__(self, *args, keys: CurveKeys | None = None, routing_id: str | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.keys = keys
        self.routing_id = routing_id or self.node_id

    async def start(self, control_addr: str) -> None:
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, self.routing_id.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        if self.keys is not None:
            apply_client(self._sock, self.keys)
        self._sock.connect(control_addr)
        await self.register()
        self._loops = [asyncio.create_task(self._recv_loop()), asyncio.create_task(self._heartbeat_loop())]


def test_control_addr_is_the_bound_address_and_limits_are_set(tokenizer):
    async def scenario():
        router = Router(tokenizer, MODEL)
        assert router.control_addr == ""  # until started
        await router.start()
        try:
            assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", router.control_addr)
            assert not router.control_addr.endswith((":0", ":*"))
            sock = router.control._sock
            assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES + (64 << 10)
            assert sock.getsockopt(zmq.LINGER) == 0
            assert sock.getsockopt(zmq.SNDHWM) == sock.getsockopt(zmq.RCVHWM) == 1000  # libzmq's default
        finally:
            await router.close()
        assert router.control._sock is None and router.control._ctx is None

    run(scenario())


def test_a_bind_that_fails_leaves_no_context_behind():
    first = ControlSocket("tcp://127.0.0.1:0")
    addr = first.open()
    try:
        second = ControlSocket(addr)
        with pytest.raises(zmq.ZMQError):
            second.open()
        assert second._ctx is None and second.addr == ""
    finally:
        first.close()


def test_curve_admits_only_nodes_with_the_keys(tokenizer, tmp_path):
    keys = CurveKeys.load(generate_keys(tmp_path / "keys"))
    foreign = CurveKeys.load(generate_keys(tmp_path / "foreign"))

    async def scenario():
        router = Router(tokenizer, MODEL, curve=keys)
        await router.start()
        nodes = [CurveNode("good", keys=keys), CurveNode("plain"), CurveNode("stranger", keys=foreign)]
        try:
            for node in nodes:
                await node.start(router.control_addr)
            await wait_until(lambda: "good" in router.registry.nodes, what="the node with the keys registered")
            await asyncio.sleep(0.3)  # the others had time to get in, were they able to
            assert set(router.registry.nodes) == {"good"}
        finally:
            for node in nodes:
                await node.close()
            await router.close()

    run(scenario())


@pytest.mark.timeout(30)
def test_a_flood_of_ready_messages_does_not_starve_the_event_loop():
    """Messages already queued make every receive complete at once, so without yielding the loop
    would handle all of them before any HTTP handler ran again: it yields every YIELD_EVERY."""
    from pdserve.protocol.messages import Heartbeat, encode
    from pdserve.router.control import YIELD_EVERY

    num_messages = 20 * YIELD_EVERY

    async def scenario() -> list[int]:
        control = ControlSocket("tcp://127.0.0.1:0")
        addr = control.open()
        sender = zmq.Context.instance().socket(zmq.DEALER)
        sender.setsockopt(zmq.LINGER, 0)
        sender.setsockopt(zmq.IDENTITY, b"n0")
        ticks, seen = [0], []
        done = asyncio.Event()

        async def ticker() -> None:  # stands in for the HTTP side: runs whenever the loop is free
            while True:
                ticks[0] += 1
                await asyncio.sleep(0)

        async def handle(identity, msg, peer_key) -> None:
            seen.append(ticks[0])
            if len(seen) == num_messages:
                done.set()

        try:
            sender.connect(addr)
            data = encode(Heartbeat(node_id="n0", num_free_blocks=1, num_total_blocks=1, num_running=0, num_waiting=0))
            for _ in range(num_messages):
                sender.send(data, zmq.NOBLOCK)
            await asyncio.sleep(1.0)  # every message is queued at the router before it reads one
            tick_task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            recv_task = asyncio.create_task(control.recv_loop(handle))
            await asyncio.wait_for(done.wait(), 10)
            for task in (tick_task, recv_task):
                task.cancel()
            await asyncio.gather(tick_task, recv_task, return_exceptions=True)
        finally:
            sender.close(0)
            control.close()
        return seen

    seen = run(scenario())
    # Without the yield the ticker would not run at all between the first and the last message.
    assert seen[-1] - seen[0] >= num_messages // YIELD_EVERY - 2
