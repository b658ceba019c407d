"""Router scale-out with real processes: `pdserve router --api-server-count 2` (two router
processes on one port, SO_REUSEPORT) in front of prefill and decode nodes that register with both.
Every stream's output equals transformers' greedy one, both routers carry traffic (each response
names its process: X-Pdserve-Api-Server), and a router killed mid-stream loses only its own
clients' streams: the other router's complete exactly and the nodes free the dead router's
requests, ending with no block in use."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading

import pytest

from pdserve.router.cli import API_SERVER_HEADER
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import hf_greedy, prompts
from tests.e2e.test_faults import assert_no_blocks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
SMALL_POOL = ["--kv-cache-memory-gb", "0.1"]


class Stream:
    """One streamed completion in a thread: which API server answered, the token ids, and how it ended."""

    def __init__(self, cluster: Cluster, prompt: list[int], max_tokens: int) -> None:
        self.server: int | None = None
        self.ids: list[int] = []
        self.error: str | None = None
        self.done = False
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
                "stream": True}
        self.thread = threading.Thread(target=self._run, args=(cluster.port, body), daemon=True)
        self.thread.start()

    def _run(self, port: int, body: dict) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.server = int(resp.headers[API_SERVER_HEADER])
            for raw in resp:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]["message"]
                        return
                    for choice in event["choices"]:
                        self.ids += choice.get("token_ids", [])
            self.error = "connection: the stream ended without [DONE]"
        except (OSError, http.client.HTTPException) as e:  # reset, IncompleteRead, ...
            self.error = f"connection: {type(e).__name__}: {e}"
        finally:
            conn.close()
            self.done = True


def nodes_seen_by(port: int) -> tuple[int, set[str]]:
    """(the API server that answered, the ready nodes it knows), over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/nodes")
        resp = conn.getresponse()
        nodes = json.loads(resp.read())["nodes"]
        return int(resp.headers[API_SERVER_HEADER]), {n["node_id"] for n in nodes if n["ready"]}
    finally:
        conn.close()


def wait_every_router_sees(cluster: Cluster, names: list[str], count: int = 2, timeout: float = 120) -> None:
    """Until each of the `count` API servers has answered /nodes with every named node ready."""
    seen: set[int] = set()

    def all_seen() -> bool:
        try:
            server, ready = nodes_seen_by(cluster.port)
        except (OSError, http.client.HTTPException, ValueError):
            return False
        if ready >= set(names):
            seen.add(server)
        return len(seen) == count
    Cluster.wait(all_seen, timeout, f"every router seeing {names}")


def start(cluster: Cluster, names: dict[str, str], *extra: str) -> None:
    cluster.start_router()
    for name, role in names.items():
        cluster.start_node(name, role, *SMALL_POOL, *extra)
    wait_every_router_sees(cluster, list(names))


@pytest.fixture
def cluster(model_dir):
    c = Cluster(str(model_dir[0]), api_server_count=2)
    yield c
    c.close()


@pytest.mark.timeout(400)
def test_two_routers_on_one_port_serve_64_streams_exactly(cluster, model_dir):
    model = model_dir[1]
    names = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    start(cluster, names)
    ps = prompts(64, seed=21, lo=5, hi=60)
    streams = [Stream(cluster, p, 10) for p in ps]
    for s in streams:
        s.thread.join(300)
    assert all(s.done for s in streams), "a stream never ended"
    for p, s in zip(ps, streams):
        assert s.error is None, s.error
        assert s.ids == hf_greedy(model, p, 10)
    per_server = {i: sum(s.server == i for s in streams) for i in (0, 1)}
    assert per_server[0] > 0 and per_server[1] > 0, per_server  # both routers carried traffic
    assert_no_blocks(cluster, list(names))
    indexed: dict[int, float] = {}  # every router indexes every node's cache, whoever sent the requests

    def every_router_indexed() -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=10)
        try:
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            text = resp.read().decode()
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()
        line = next(x for x in text.splitlines() if x.startswith("pdserve_router_kv_index_blocks "))
        indexed[int(resp.headers[API_SERVER_HEADER])] = float(line.split()[1])
        return len(indexed) == 2 and min(indexed.values()) > 0
    Cluster.wait(every_router_indexed, 30, "both routers' KV indexes")


@pytest.mark.timeout(400)
def test_a_router_killed_mid_stream_loses_only_its_own_streams(cluster, model_dir):
    model = model_dir[1]
    names = {"p0": "prefill", "d0": "decode"}
    start(cluster, names, "--step-delay-s", "0.05")  # a slow device: the kill lands mid-stream
    ps = prompts(16, seed=22, lo=5, hi=60)
    streams = [Stream(cluster, p, 40) for p in ps]
    Cluster.wait(lambda: all(len(s.ids) >= 2 or s.done for s in streams), 120, "2 tokens on every stream")
    victim = cluster.api_server_pids()[0]
    os.kill(victim, signal.SIGKILL)
    for s in streams:
        s.thread.join(300)
    assert all(s.done for s in streams), "a stream never ended"
    killed = [s for s in streams if s.server == 0]
    survived = [(p, s) for p, s in zip(ps, streams) if s.server == 1]
    assert killed and survived, [s.server for s in streams]
    cut = [s for s in killed if s.error is not None]
    assert cut and all(s.error.startswith("connection") for s in cut), [s.error for s in cut]
    for p, s in zip(ps, streams):  # cut off with a dropped connection, or (rarely) done just before the kill
        if s.server == 0 and s.error is None:
            assert s.ids == hf_greedy(model, p, 40)
    for p, s in survived:
        assert s.error is None, s.error
        assert s.ids == hf_greedy(model, p, 40)
    # The nodes freed what the dead router had sent them, and hold nothing at the end.
    dead_control = cluster.controls[0]
    Cluster.wait(lambda: f"router {dead_control} is gone: aborting its" in cluster.log("d0")
                 + cluster.log("p0"), 30, "the nodes aborting the dead router's requests")
    assert_no_blocks(cluster, list(names))
    # The parent started a new process for the dead one; the nodes register with it again.
    Cluster.wait(lambda: cluster.api_server_pids()[0] != victim, 30, "API server 0 restarted")
    wait_every_router_sees(cluster, list(names))
    again = [Stream(cluster, p, 40) for p in ps[:4]]
    for p, s in zip(ps[:4], again):
        s.thread.join(120)
        assert s.error is None and s.ids == hf_greedy(model, p, 40), s.error
