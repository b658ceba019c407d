"""Node metrics: the scrape-time collector, the status server's /metrics and /health, and a real
in-process hand-off (prefill node → decode node over ZMQ, tiny model) moving the node metrics."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from pdserve.node.metrics import NodeMetrics, NodeSnapshot
from pdserve.node.router_link import RouterLink, advertise_host, advertised_addr
from pdserve.node.status_server import StatusServer
from pdserve.protocol.messages import PrefillRequest

NODE = {"node_id": "n0", "role": "prefill"}


def samples(text: bytes | str) -> dict[tuple[str, frozenset], float]:
    text = text.decode() if isinstance(text, bytes) else text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(metrics: dict, name: str, **labels) -> float:
    return metrics[(name, frozenset(labels.items()))]


def make_snapshot(**kw) -> NodeSnapshot:
    base = dict(num_running=2, num_waiting=3, num_blocks_used=25, num_blocks_total=100, num_prefix_queries=64,
                num_prefix_hits=32, num_preemptions=1, num_bytes_sent=4096, num_leases=2,
                num_outstanding_prompt_tokens=7)
    return NodeSnapshot(**{**base, **kw})


def test_collector_reads_the_snapshot_at_every_scrape():
    metrics = NodeMetrics("n0", "prefill")
    state = {"snap": make_snapshot()}
    metrics.watch(lambda: state["snap"])
    m = samples(metrics.render())
    assert value(m, "pdserve_kv_cache_usage_perc", **NODE) == 0.25
    assert value(m, "pdserve_kv_blocks_used", **NODE) == 25 and value(m, "pdserve_kv_blocks_total", **NODE) == 100
    assert value(m, "pdserve_num_requests_running", **NODE) == 2
    assert value(m, "pdserve_num_requests_waiting", **NODE) == 3
    assert value(m, "pdserve_prefix_cache_queries_total", **NODE) == 64
    assert value(m, "pdserve_prefix_cache_hits_total", **NODE) == 32
    assert value(m, "pdserve_num_preemptions_total", **NODE) == 1
    assert value(m, "pdserve_kv_leases_held", **NODE) == 2
    assert value(m, "pdserve_num_prompt_tokens_outstanding", **NODE) == 7
    assert value(m, "pdserve_kv_transfer_bytes_total", **NODE, direction="sent") == 4096
    state["snap"] = make_snapshot(num_blocks_used=0, num_blocks_total=0)  # an empty pool reads 0, not NaN
    assert value(samples(metrics.render()), "pdserve_kv_cache_usage_perc", **NODE) == 0.0


def test_transfer_histograms():
    metrics = NodeMetrics("d0", "decode")
    metrics.observe_transfer(8 << 20, 0.004)  # 8 MiB in 4 ms ≈ 2.1 GB/s
    metrics.observe_transfer(1024, 0.0)  # too fast to time: no bandwidth sample
    m = samples(metrics.render())
    labels = {"node_id": "d0", "role": "decode"}
    assert value(m, "pdserve_kv_transfer_seconds_count", **labels) == 2
    assert value(m, "pdserve_kv_transfer_bandwidth_bytes_per_second_count", **labels) == 1
    assert value(m, "pdserve_kv_transfer_bandwidth_bytes_per_second_sum", **labels) == pytest.approx((8 << 20) / 0.004)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_status_server_health_waits_for_ready_and_serves_metrics():
    server = StatusServer("127.0.0.1", 0, advertise_host="node.example")
    try:
        local = "http://127.0.0.1:" + server.url.rsplit(":", 1)[1]
        assert server.url.startswith("http://node.example:")
        assert _get(local + "/health")[0] == 503
        assert _get(local + "/metrics")[0] == 404  # no node yet
        assert _get(local + "/status") == (200, b'{"ready": false}')
        metrics = NodeMetrics("n0", "prefill")
        metrics.watch(make_snapshot)
        server.set_ready(lambda: {"node_id": "n0"}, metrics.render)
        assert _get(local + "/health")[0] == 200
        assert _get(local + "/status") == (200, b'{"node_id": "n0"}')
        code, body = _get(local + "/metrics")
        assert code == 200 and value(samples(body), "pdserve_kv_blocks_total", **NODE) == 100
    finally:
        server.close()


def test_advertised_address():
    assert advertise_host("127.0.0.1") == "127.0.0.1"
    assert advertise_host("0.0.0.0", "prefill-1.local") == "prefill-1.local"
    assert advertise_host("0.0.0.0") not in ("0.0.0.0", "")  # this machine's own address
    assert advertised_addr("tcp://0.0.0.0:9200", "10.0.0.7") == "tcp://10.0.0.7:9200"


# ---- a real hand-off between two in-process nodes -------------------------------------------
def make_engine(model_dir):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_path=model_dir, dtype="float32", num_kv_blocks=64, num_threads=1))


class NodePair:
    """A prefill node and a decode node on one tiny model, in process (KV over ZMQ); a ROUTER
    socket stands in for the router and takes what the nodes send."""

    def __init__(self, model_dir):
        from pdserve.decode_node.node import DecodeNode
        from pdserve.kvtransfer.receiver import KVReceiver
        from pdserve.kvtransfer.sender import KVSender
        from pdserve.node.engine_wire import kv_layout, register_message
        from pdserve.prefill_node.node import PrefillNode

        self.router = zmq.Context.instance().socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        addr = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        pe, de = make_engine(model_dir), make_engine(model_dir)
        self.prefill = PrefillNode(pe, RouterLink(addr, register_message("p0", "prefill", pe, "tiny")),
                                   make_sender=lambda release, on_error: KVSender(
                                       "p0", kv_layout(pe, "tiny"), pe.runner.kv_buffer, release))
        self.receiver = KVReceiver("d0", kv_layout(de, "tiny"), de.runner.kv_buffer)
        self.decode = DecodeNode(de, RouterLink(addr, register_message("d0", "decode", de, "tiny")), self.receiver)

    def close(self):
        for closer in (self.prefill.sender, self.receiver, self.prefill.link, self.decode.link):
            closer.close()
        self.router.close(0)


def test_handoff_moves_node_metrics(tiny_llama, no_leak):
    nodes = NodePair(tiny_llama)
    prefill, decode, receiver = nodes.prefill, nodes.decode, nodes.receiver
    pe, de = prefill.engine, decode.engine
    prompt = list(range(3, 40))
    try:
        for engine in (pe, de):
            engine.warm_up()
            assert engine.block_manager.num_prefix_queries == 0 and engine.block_manager.num_used_blocks == 0
        prefill.handle(PrefillRequest("r1", prompt, {"max_tokens": 4, "temperature": 0, "ignore_eos": True},
                                      "d0", receiver.kv_addr))
        queued = samples(prefill.metrics.render())  # before any step: the whole prompt is outstanding
        deadline = time.monotonic() + 60
        while not (prefill.is_idle() and decode.is_idle() and decode.requests.recent):
            assert time.monotonic() < deadline, "the hand-off did not finish"
            prefill.run_once()
            decode.run_once()
        p, d = samples(prefill.metrics.render()), samples(decode.metrics.render())
    finally:
        nodes.close()
    num_bytes = len(prompt) * pe.model_config.kv_elements_per_token * 4
    dl = {"node_id": "d0", "role": "decode"}
    assert value(p, "pdserve_prefix_cache_queries_total", **NODE | {"node_id": "p0"}) == len(prompt)
    assert value(p, "pdserve_kv_transfer_bytes_total", node_id="p0", role="prefill", direction="sent") == num_bytes
    assert value(d, "pdserve_kv_transfer_bytes_total", **dl, direction="received") == num_bytes
    assert value(d, "pdserve_kv_bytes_received_by_rank_total", **dl, rank="0") == num_bytes  # no TP: one rank
    assert not [k for k in d if k[0] == "pdserve_kv_bytes_received_by_rank_total" and ("rank", "1") in k[1]]
    assert value(d, "pdserve_kv_transfers_total", **dl, path="zmq") == 1
    assert value(d, "pdserve_kv_transfer_seconds_count", **dl) == 1
    assert value(d, "pdserve_kv_transfer_bandwidth_bytes_per_second_count", **dl) == 1
    assert value(p, "pdserve_kv_leases_held", node_id="p0", role="prefill") == 0
    assert value(queued, "pdserve_num_prompt_tokens_outstanding", node_id="p0", role="prefill") == len(prompt)
    assert value(p, "pdserve_num_prompt_tokens_outstanding", node_id="p0", role="prefill") == 0
    assert value(d, "pdserve_kv_blocks_used", **dl) == 0
    no_leak(pe.block_manager)
    no_leak(de.block_manager)
