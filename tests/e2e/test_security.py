"""Security end to end: CURVE-encrypted control and KV traffic between real processes, nodes
without the keys locked out and counted (pdserve_auth_refusals_total), a node id held by its
first key against a second allowed key, and the router's API key."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request

import pytest
import zmq.auth
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protocol.curve import generate_keys
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


def client_dir(keys, directory):
    """A key directory with `keys`' server keypair and a client keypair of its own: a node that
    knows our server but whose client key the router admits only if its client.key is copied in."""
    directory.mkdir(mode=0o700)
    for name in ("server.key", "server.key_secret"):
        shutil.copy(keys / name, directory / name)
    zmq.auth.create_certificates(directory, "client")
    return directory


def refusals(cluster) -> dict[str, float]:
    text = _get(cluster.url + "/metrics")  # no API key needed there
    return {s.labels["reason"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "pdserve_auth_refusals_total"}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read().decode()


@pytest.mark.timeout(600)
def test_curve_cluster_with_api_key(model_dir, tmp_path):
    keys, foreign = tmp_path / "keys", tmp_path / "foreign"
    generate_keys(keys)
    generate_keys(foreign)
    unknown = client_dir(keys, tmp_path / "unknown")  # our server key, a client key not admitted
    second = client_dir(keys, tmp_path / "second")  # our server key, a client key admitted below
    shutil.copy(second / "client.key", keys / "second.key")  # before the router starts
    cluster = Cluster(str(model_dir[0]), router_args=["--zmq-curve-keys", str(keys)], api_key="s3cret")
    try:
        cluster.start_router()
        curve = ["--zmq-curve-keys", str(keys)]
        cluster.start_node("p0", "prefill", "--no-shm", *curve)  # KV over (encrypted) TCP
        cluster.start_node("d0", "decode", *curve)
        cluster.start_node("plain", "decode")  # no keys
        cluster.start_node("stranger", "decode", "--zmq-curve-keys", str(foreign))  # keys the router never saw
        cluster.start_node("unknown", "decode", "--zmq-curve-keys", str(unknown))  # a client key it refuses
        cluster.wait_nodes(["p0", "d0"])
        # An admitted second key claims p0's node id while p0 is connected: libzmq ignores its
        # connections (the router turns ROUTER_HANDOVER off under CURVE), and the router would
        # refuse it anyway (node_id_taken: tests/router/test_identity.py).
        cluster.start_node("impostor", "prefill", "--zmq-curve-keys", str(second), "--node-id", "p0", "--no-shm")
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
            assert cluster.alive("plain") and cluster.alive("stranger") and cluster.alive("unknown")
            assert cluster.alive("impostor")
            assert {n["node_id"] for n in cluster.nodes()} == {"p0", "d0"}
            assert cluster.status_of("p0")["pid"] == cluster.pid("p0")  # p0 is still the first p0
            time.sleep(1)
        for p in prompts(2, seed=22, lo=5, hi=80):  # still serving exactly, the impostor up
            status, body = post(cluster.url, {"prompt": p, "max_tokens": 12, "temperature": 0,
                                              "return_token_ids": True}, key="s3cret")
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == hf_greedy(model_dir[1], p, 12)
        # Every refused handshake is counted at the router (a plain peer is no_curve, or
        # handshake when it hung up first; another key directory's peer is handshake).
        counts = refusals(cluster)
        assert counts["unknown_key"] >= 1 and counts["handshake"] >= 1, counts
        assert counts["no_curve"] + counts["handshake"] >= 2, counts
    finally:
        cluster.close()
