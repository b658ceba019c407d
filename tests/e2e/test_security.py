"""Security end to end: CURVE-encrypted control and KV traffic between real processes, nodes
without the keys locked out, and the router's API key."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

from pdserve.kvtransfer.curve import generate_keys
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import hf_greedy, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_curve_cluster_with_api_key(model_dir, tmp_path):
    keys, foreign = tmp_path / "keys", tmp_path / "foreign"
    generate_keys(keys)
    generate_keys(foreign)
    cluster = Cluster(str(model_dir[0]), router_args=["--zmq-curve-keys", str(keys)], api_key="s3cret")
    try:
        cluster.start_router()
        curve = ["--zmq-curve-keys", str(keys)]
        cluster.start_node("p0", "prefill", "--no-shm", *curve)  # KV over (encrypted) TCP
        cluster.start_node("d0", "decode", *curve)
        cluster.start_node("plain", "decode")  # no keys
        cluster.start_node("stranger", "decode", "--zmq-curve-keys", str(foreign))  # keys the router never saw
        cluster.wait_nodes(["p0", "d0"])
        for p in prompts(3, seed=21, lo=5, hi=80):
            status, body = post(cluster.url, {"prompt": p, "max_tokens": 12, "temperature": 0,
                                              "return_token_ids": True}, key="s3cret")
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == hf_greedy(model_dir[1], p, 12)
        assert post(cluster.url, {"prompt": "hi"})[0] == 401
        status, body = post(cluster.url, {"prompt": "hi"}, key="wrong")
        assert status == 401 and body["error"]["code"] == 401
        # The nodes without the right keys are up (their status pages answer) but never got in.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert cluster.alive("plain") and cluster.alive("stranger")
            assert {n["node_id"] for n in cluster.nodes()} == {"p0", "d0"}
            time.sleep(1)
    finally:
        cluster.close()
