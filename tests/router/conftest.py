"""Router test factories: the tiny byte-level tokenizer (with a chat template), and `serving`, which
starts a Router, its aiohttp app on a test server, and fake nodes, all in one event loop.

pytest-asyncio is not a dependency: each test runs its scenario with `run(coro)`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.router.app import create_app
from pdserve.router.router import Router
from tests.conftest import save_tiny_tokenizer
from tests.router.fake_node import FakeNode

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL = "tiny"


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    tok = save_tiny_tokenizer(tmp_path_factory.mktemp("router-tokenizer"))
    tok.chat_template = CHAT_TEMPLATE
    return tok


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Harness:
    router: Router
    client: TestClient
    nodes: dict[str, FakeNode]

    async def add_node(self, node: FakeNode, wait_ready: bool = True) -> FakeNode:
        self.nodes[node.node_id] = node
        await node.start(self.router.control_addr)
        if wait_ready:
            await wait_until(lambda: node.node_id in self.router.registry.nodes
                             and self.router.registry.nodes[node.node_id].ready, what=f"{node.node_id} ready")
        return node

    async def post(self, path: str, body: dict) -> tuple[int, dict]:
        resp = await self.client.post(path, json=body)
        return resp.status, await resp.json()

    async def stream(self, path: str, body: dict) -> list:
        """POST with stream=true; returns the decoded SSE events ('[DONE]' stays a string)."""
        resp = await self.client.post(path, json={**body, "stream": True})
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = []
        async for line in resp.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        return events


@contextlib.asynccontextmanager
async def serving(tokenizer, *nodes: FakeNode, **router_kw) -> AsyncIterator[Harness]:
    router = Router(tokenizer, MODEL, **router_kw)
    await router.start()
    client = TestClient(TestServer(create_app(router)))
    await client.start_server()
    harness = Harness(router, client, {})
    try:
        for node in nodes:
            await harness.add_node(node)
        yield harness
    finally:
        await client.close()
        for node in harness.nodes.values():
            await node.close()
        await router.close()


def split_pair(**decode_kw) -> tuple[FakeNode, FakeNode]:
    """A prefill fake and a decode fake that hand requests to each other."""
    cluster: dict[str, FakeNode] = {}
    prefill = FakeNode("p0", "prefill", cluster=cluster)
    return prefill, FakeNode("d0", "decode", cluster=cluster, **decode_kw)
