"""Every metric a Grafana panel queries is one the code exports (router and node metrics built
in-process, no model), and the dashboard covers what DESIGN.md promises."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdserve.node.metrics import NodeMetrics, NodeSnapshot
from pdserve.router.router import Router
from tests.docker.compose import dashboard_exprs, metric_names

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def series_names(registry: CollectorRegistry) -> set[str]:
    """Series names a registry exports, from each family's type: a labelled histogram or counter
    with no observation yet has no samples, but its series names are known."""
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def exported() -> set[str]:
    router = Router(None, "tiny")  # its metrics only; no socket until start()
    node = NodeMetrics("n0", "prefill")
    node.watch(lambda: NodeSnapshot(0, 0, 0, 16, 0, 0, 0))
    return series_names(router.metrics.registry) | series_names(node.registry)


def test_every_dashboard_metric_is_exported():
    names = set().union(*(metric_names(e) for e in dashboard_exprs()))
    assert names, "no pdserve_ metric found in the dashboard"
    missing = sorted(names - exported())
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"


def test_dashboard_covers_the_promised_signals():
    exprs = "\n".join(dashboard_exprs())
    for metric in ("pdserve_generation_tokens_total", "pdserve_time_to_first_token_seconds_bucket",
                   "pdserve_time_per_output_token_seconds_bucket", "pdserve_inter_token_latency_seconds_bucket",
                   "pdserve_e2e_request_latency_seconds_bucket", "pdserve_ttft_stage_seconds",
                   "pdserve_num_requests_waiting", "pdserve_kv_cache_usage_perc", "pdserve_prefix_cache_hits_total",
                   "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_bandwidth_bytes_per_second_bucket",
                   "pdserve_num_preemptions_total"):
        assert metric in exprs, metric
    assert "histogram_quantile(0.99" in exprs


def test_metric_names_are_found_whole():
    expr = 'histogram_quantile(0.9, sum by (le) (rate(pdserve_e2e_request_latency_seconds_bucket{job="x"}[1m])))'
    assert metric_names(expr) == {"pdserve_e2e_request_latency_seconds_bucket"}
