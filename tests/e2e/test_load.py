"""Load: 1,000 requests at once (request rate inf) through 2 prefill + 2 decode nodes. Zero
failures: a 429 is retried by the client after its Retry-After, as a well-behaved client does,
and must end in success. Every process's resident memory after the run is within 10% of its
level after a warm-up run of the same shape (no per-request leak in router or nodes)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import aiohttp
import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import hf_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NODES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}


def rss_mb(pid: int) -> float:
    status = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def workload(n: int, seed: int, max_tokens: tuple[int, int] = (32, 128)) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(3, 256) for _ in range(rng.randint(8, 100))],
             "max_tokens": rng.randint(*max_tokens), "temperature": 0, "ignore_eos": True,
             "return_token_ids": True, "stream": rng.random() < 0.5} for _ in range(n)]


async def one(session: aiohttp.ClientSession, url: str, body: dict, tally: dict) -> list[int]:
    """One request to success: 429s are retried after Retry-After; anything else fails the test."""
    while True:
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status == 429:
                tally["429"] += 1
                await asyncio.sleep(float(resp.headers["Retry-After"]) * (0.5 + random.random()))
                continue
            assert resp.status == 200, await resp.text()
            if not body["stream"]:
                return (await resp.json())["choices"][0]["token_ids"]
            ids, done = [], False
            async for line in resp.content:
                line = line.decode().strip()
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    ids += event["choices"][0].get("token_ids", [])
            assert done
            return ids


async def run_all(url: str, bodies: list[dict]) -> tuple[list[list[int]], dict]:
    tally = {"429": 0}
    timeout = aiohttp.ClientTimeout(total=1800, sock_read=300)  # five silent minutes is a hang
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        outs = await asyncio.gather(*(one(session, url, b, tally) for b in bodies))
    return outs, tally


@pytest.mark.timeout(1200)  # two rounds of 1,000 requests through four nodes on two cores
def test_1000_requests_at_rate_inf_with_flat_memory(model_dir):
    cluster = Cluster(str(model_dir[0]), router_args=["--max-queue", "64"],
                      node_args=["--kv-cache-memory-gb", "0.25"])
    try:
        cluster.start_router()
        for name, role in NODES.items():
            cluster.start_node(name, role)
        cluster.wait_nodes(NODES)
        # Warm-up: the same shape (allocators keep their peak, so a smaller warm-up would not compare).
        warm = workload(1000, seed=1)
        outs, _ = asyncio.run(run_all(cluster.url, warm))
        assert [len(o) for o in outs] == [b["max_tokens"] for b in warm]
        time.sleep(2)
        names = ["router", *NODES]
        before = {n: rss_mb(cluster.pid(n)) for n in names}

        bodies = workload(1000, seed=2)
        start = time.monotonic()
        outs, tally = asyncio.run(run_all(cluster.url, bodies))
        elapsed = time.monotonic() - start
        assert [len(o) for o in outs] == [b["max_tokens"] for b in bodies]  # zero failures
        for i in range(0, 1000, 100):  # and the tokens are right
            b = bodies[i]
            assert outs[i] == _greedy_ignoring_eos(model_dir[1], b["prompt"], b["max_tokens"])
        time.sleep(2)
        after = {n: rss_mb(cluster.pid(n)) for n in names}
        print(f"\nload: 1000 requests in {elapsed:.1f} s, {sum(len(o) for o in outs) / elapsed:.0f} output tok/s, "
              f"{tally['429']} 429s retried; RSS MB after warm-up {before}, after the run {after}")
        for n in names:
            assert after[n] <= 1.10 * before[n], f"{n}: RSS {before[n]:.0f} MB -> {after[n]:.0f} MB"
        for n in NODES:
            s = cluster.status_of(n)
            assert s["num_used_blocks"] == 0 and s["num_running"] == 0, s
    finally:
        cluster.close()


def _greedy_ignoring_eos(model, prompt, max_tokens):
    model.generation_config.eos_token_id = None
    try:
        return hf_greedy(model, prompt, max_tokens)
    finally:
        model.generation_config.eos_token_id = 257
