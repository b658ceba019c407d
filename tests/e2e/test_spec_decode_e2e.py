"""Speculative decoding through P→D: the decode nodes speculate (ngram or a draft model whose KV
they build themselves), the prefill node does not. Greedy streams equal transformers' greedy
output, also with a decode pool small enough to preempt and when a decode node dies mid-stream
(the router re-dispatches; the new attempt speculates from the tokens streamed so far); no
block is left held, and the decode node's /metrics count drafts and accepted tokens."""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.e2e.cluster import Cluster
from tests.e2e.conftest import prompts
from tests.e2e.test_faults import MAX_TOKENS, Streams, assert_exact, assert_no_blocks, retries
from tests.engine.spec_helpers import copy_prompts, noisy_draft

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return noisy_draft(tmp_path_factory.mktemp("e2e-noisy-draft"))


@pytest.fixture
def cluster(model_dir):
    c = Cluster(str(model_dir[0]), node_args=["--kv-cache-memory-gb", "0.1"])
    yield c
    c.close()


def spec_counters(cluster: Cluster, name: str) -> dict[str, float]:
    node = next(n for n in cluster.nodes() if n["node_id"] == name)
    with urllib.request.urlopen(node["status_url"] + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("pdserve_spec_decode_num_") and "_per_pos" not in line}


def workload() -> list[list[int]]:
    return copy_prompts(6, seed=21) + prompts(4, seed=22, lo=5, hi=80)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_pd_greedy_is_exact_with_speculation_and_preemption(cluster, model_dir, draft_dir, method):
    spec = NGRAM if method == "ngram" else json.dumps({"model": str(draft_dir), "num_speculative_tokens": 3})
    cluster.start_router()
    cluster.start_node("p0", "prefill")
    # 32 blocks of 4 tokens: 10 requests of up to 120 tokens do not fit at once, so some are preempted
    cluster.start_node("d0", "decode", "--speculative-config", spec, "--num-kv-blocks", "32", "--block-size", "4")
    cluster.wait_nodes(["p0", "d0"])
    ps = workload()
    streams = Streams(cluster, ps)
    streams.join()
    assert_exact(model_dir[1], ps, streams)
    counters = spec_counters(cluster, "d0")
    assert counters["pdserve_spec_decode_num_accepted_tokens_total"] > 0, counters
    assert counters["pdserve_spec_decode_num_draft_tokens_total"] >= counters[
        "pdserve_spec_decode_num_accepted_tokens_total"]
    assert cluster.status_of("d0")["num_preemptions"] > 0
    assert_no_blocks(cluster, ["p0", "d0"])


def test_kill_a_speculating_decode_node_mid_stream(cluster, model_dir, draft_dir):
    spec = json.dumps({"model": str(draft_dir), "num_speculative_tokens": 3})
    cluster.start_router()
    cluster.start_node("p0", "prefill")
    cluster.start_node("d0", "decode", "--speculative-config", spec, "--step-delay-s", "0.05")
    cluster.start_node("d1", "decode", "--speculative-config", NGRAM, "--step-delay-s", "0.05")
    cluster.wait_nodes(["p0", "d0", "d1"])
    ps = workload()
    streams = Streams(cluster, ps)
    streams.wait_tokens(3)
    victim = max(("d0", "d1"), key=lambda n: cluster.status_of(n)["num_running"])
    assert cluster.status_of(victim)["num_running"] > 0
    cluster.kill(victim)
    streams.join()
    assert not any(streams.errors), streams.errors
    assert_exact(model_dir[1], ps, streams)
    assert all(len(ids) <= MAX_TOKENS for ids in streams.ids)
    assert retries(cluster) >= 1
    assert_no_blocks(cluster, ["p0", "d0" if victim == "d1" else "d1"])


def test_colocated_node_speculates_too(cluster, model_dir):
    cluster.start_router()
    cluster.start_node("c0", "both", "--speculative-config", NGRAM)
    cluster.wait_nodes(["c0"])
    ps = workload()
    streams = Streams(cluster, ps)
    streams.join()
    assert_exact(model_dir[1], ps, streams)
    assert spec_counters(cluster, "c0")["pdserve_spec_decode_num_accepted_tokens_total"] > 0
    assert_no_blocks(cluster, ["c0"])
