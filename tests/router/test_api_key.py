"""The optional API key: every request outside /health, /metrics and /openapi.json needs
`Authorization: Bearer <key>`; a missing or wrong key is a 401 with an OpenAI error body."""

from __future__ import annotations

import contextlib

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pdserve.router.app import create_app
from tests.router.conftest import MODEL, run, serving
from tests.router.fake_node import FakeNode

KEY = "sk-test-0123456789"
COMPLETION = {"prompt": "hi", "max_tokens": 3}


@contextlib.asynccontextmanager
async def keyed(tokenizer):
    """A fake node, and a client of an app with KEY in front of the harness's router."""
    async with serving(tokenizer, FakeNode("n0")) as h:
        client = TestClient(TestServer(create_app(h.router, api_key=KEY)))
        await client.start_server()
        try:
            yield h, client
        finally:
            await client.close()


def auth(value: str) -> dict:
    return {"Authorization": value}


async def assert_401(resp, message: str) -> None:
    assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
    error = (await resp.json())["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401 and message in error["message"]


def test_missing_or_wrong_key_is_401(tokenizer):
    async def scenario():
        async with keyed(tokenizer) as (h, client):
            await assert_401(await client.post("/v1/completions", json=COMPLETION), "missing API key")
            await assert_401(await client.get("/v1/models"), "missing API key")
            await assert_401(await client.get("/nodes"), "missing API key")
            await assert_401(await client.get("/v1/nothing"), "missing API key")  # closed by default
            for header in ("Bearer wrong", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", "Bearer ключ"):  # not ASCII:
                resp = await client.post("/v1/chat/completions", headers=auth(header),  # compared as bytes
                                         json={"messages": [{"role": "user", "content": "x"}]})
                await assert_401(resp, "Incorrect API key provided")
            await assert_401(await client.get("/v1/models", headers=auth(f"Basic {KEY}")), "missing API key")
            await assert_401(await client.get("/v1/models", headers=auth("Bearer ")), "missing API key")
            assert not h.nodes["n0"].prefills  # nothing reached a node

    run(scenario())


def test_right_key_passes_and_probes_stay_open(tokenizer):
    async def scenario():
        async with keyed(tokenizer) as (h, client):
            bearer = auth(f"bearer {KEY}")  # the scheme is case-insensitive
            resp = await client.post("/v1/completions", json=COMPLETION, headers=bearer)
            assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
            assert (await client.get("/v1/nothing", headers=bearer)).status == 404
            for path in ("/health", "/metrics", "/openapi.json"):
                assert (await client.get(path)).status == 200, path
            spec = await (await client.get("/openapi.json")).json()
            assert spec["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
            assert "security" not in spec["paths"]["/health"]["get"]
            open_spec = await (await h.client.get("/openapi.json")).json()  # the harness's app has no key
            assert "security" not in open_spec["paths"]["/v1/models"]["get"]

    run(scenario())


def test_openai_client_sends_the_key_as_bearer(tokenizer):
    openai = pytest.importorskip("openai")

    async def scenario():
        async with keyed(tokenizer) as (_, client):
            base_url = str(client.make_url("/v1"))
            good = openai.AsyncOpenAI(api_key=KEY, base_url=base_url, max_retries=0)
            out = await good.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert out.usage.completion_tokens == 2
            bad = openai.AsyncOpenAI(api_key="nope", base_url=base_url, max_retries=0)
            with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
                await bad.models.list()
            await good.close()
            await bad.close()

    run(scenario())
