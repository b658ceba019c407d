"""The router's control socket (router/control.py): the bound address, the socket's limits, a bind
that fails, and CURVE: only nodes holding the cluster's keys can register."""

from __future__ import annotations

import asyncio
import re

import pytest
import zmq

from pdserve.kvtransfer.curve import CurveKeys, apply_client, generate_keys
from pdserve.kvtransfer.messages import MAX_MESSAGE_BYTES
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
