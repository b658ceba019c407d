"""Multi-turn conversations on a real stack (router, 1 prefill + 2 decode processes): each next turn
is routed to the decode node that holds its history, prefilled there (only the new tokens), and no
KV moves; a node killed mid-conversation leaves the index within the heartbeat timeout and the next
turn goes elsewhere; a follow-up prefilled on a prefill node moves only the KV the decode node
lacks; a router restarted late routes by the caches again from the nodes' snapshots.
Every output equals transformers' greedy one."""

from __future__ import annotations

import random
import re
import signal
import time
import urllib.request

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import hf_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

MAX_TOKENS = 12


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    """The value of one series (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def _received(cluster: Cluster, name: str) -> float:
    node = next(n for n in cluster.nodes() if n["node_id"] == name)
    return _sample(_metrics(node["status_url"]), "pdserve_kv_transfer_bytes_total", direction="received")


def _turn(cluster: Cluster, prompt: list[int]) -> tuple[list[int], int]:
    status, body = cluster.post("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                    "ignore_eos": True, "return_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    return choice["token_ids"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _cached_paths(cluster: Cluster) -> float:
    return _sample(_metrics(cluster.url), "pdserve_router_prefill_path_total", path="local", reason="cached")


@pytest.fixture
def cluster(model_dir):
    c = Cluster(str(model_dir[0]), heartbeat_timeout_s=1.5)
    yield c
    c.close()


def test_follow_up_turns_reuse_the_decode_nodes_kv(cluster, model_dir):
    model = model_dir[1]
    cluster.start_router()
    cluster.start_node("p0", "prefill")
    for name in ("d0", "d1"):
        cluster.start_node(name, "decode")
    cluster.wait_nodes(["p0", "d0", "d1"])
    rng = random.Random(3)
    history = [rng.randrange(3, 256) for _ in range(120)]

    # Turn 1: prefill node, KV handed to a decode node.
    before = {n: _received(cluster, n) for n in ("d0", "d1")}
    out, _ = _turn(cluster, history)
    assert out == hf_greedy(model, history, MAX_TOKENS)
    moved = {n: _received(cluster, n) - before[n] for n in ("d0", "d1")}
    holder = max(moved, key=moved.get)
    assert moved[holder] > 0
    other = "d1" if holder == "d0" else "d0"

    # Turn 2: the history + the reply + a new message, on the holder, no KV moved.
    prompt = history + out + [rng.randrange(3, 256) for _ in range(10)]
    before = {n: _received(cluster, n) for n in ("d0", "d1")}
    time.sleep(0.5)  # the decode node's KV events (sent after each step; staleness is milliseconds)
    out, cached = _turn(cluster, prompt)
    assert out == hf_greedy(model, prompt, MAX_TOKENS)
    assert _cached_paths(cluster) == 1
    assert cached >= (len(history) + MAX_TOKENS - 1) // 16 * 16 - 16  # the history's blocks, from the holder
    assert {n: _received(cluster, n) - before[n] for n in ("d0", "d1")} == {"d0": 0, "d1": 0}
    per_token = moved[holder] / len(history)

    # A long new part (past --cached-prefill-max-tokens): prefilled on p0, decoded on the holder,
    # which pulls only what its cache lacks: the history's blocks stay, the new tokens move.
    held = prompt + out
    prompt = held + [rng.randrange(3, 256) for _ in range(300)]
    before = _received(cluster, holder)
    out, _ = _turn(cluster, prompt)
    assert out == hf_greedy(model, prompt, MAX_TOKENS)
    moved_now = _received(cluster, holder) - before
    assert 300 * per_token <= moved_now <= (len(prompt) - len(held) // 16 * 16 + 16) * per_token < len(prompt) * per_token

    # The holder dies: its entries leave the index with it, and turn 3 is served elsewhere, exactly.
    cluster.kill(holder)
    Cluster.wait(lambda: holder not in {n["node_id"] for n in cluster.nodes()}, 10, f"{holder} dropped")
    prompt = prompt + out + [rng.randrange(3, 256) for _ in range(10)]
    before_other = _received(cluster, other)
    out, _ = _turn(cluster, prompt)
    assert out == hf_greedy(model, prompt, MAX_TOKENS)
    assert _received(cluster, other) > before_other  # prefilled on p0, handed to the survivor
    assert _cached_paths(cluster) == 1

    # A router started late: from the nodes' snapshots it sends turn 4 to the survivor, which holds turn 3.
    cluster.kill("router", signal.SIGKILL)
    cluster.start_router()
    cluster.wait_nodes(["p0", other])
    prompt = prompt + out + [rng.randrange(3, 256) for _ in range(10)]
    before_other = _received(cluster, other)
    Cluster.wait(lambda: _sample(_metrics(cluster.url), "pdserve_router_kv_events_total", op="stored") > 0, 10,
                 "the snapshots")
    out, cached = _turn(cluster, prompt)
    assert out == hf_greedy(model, prompt, MAX_TOKENS)
    assert _cached_paths(cluster) == 1 and cached > len(history)
    assert _received(cluster, other) == before_other
    text = _metrics(cluster.url)
    assert re.search(r"pdserve_router_kv_event_staleness_seconds_count [1-9]", text)
    assert _sample(text, "pdserve_router_kv_index_blocks") >= len(prompt) // 16  # the survivor's and p0's blocks
