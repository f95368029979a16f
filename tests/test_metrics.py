"""utils/serve/metrics.py in-process: the prefix caches' ``stats()`` figures as Prometheus series
(the callable is read at each scrape), and each app's own registry (nothing in prometheus_client's
global one). The live checks (exact counts after real requests through the official `openai`
client, /metrics behind the API key) are tests/test_serve.py's, on its module's server."""
from __future__ import annotations

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from utils.serve.metrics import ServeMetrics


def _samples(metrics: ServeMetrics) -> dict:
    body, kind = metrics.render()
    assert kind.startswith("text/plain; version=")
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(body.decode()) for x in family.samples}


def test_prefix_cache_stats_are_read_at_each_scrape():
    """hit and queried tokens as vLLM's counter pair, their ratio since start, and the block
    and byte gauges, per model, as the callable says at the moment of the scrape."""
    stats = {"a": dict(hit_tokens=0, queried_tokens=0, blocks_used=0, blocks_capacity=64,
                       bytes_used=0, bytes_budget=1 << 20)}
    metrics = ServeMetrics({}, prefix_stats=lambda: stats)
    first = _samples(metrics)
    a = (("model_name", "a"),)
    assert first[("llm_prefix_cache_hits_total", a)] == 0 and first[("llm_prefix_cache_hit_rate", a)] == 0
    stats["a"].update(hit_tokens=30, queried_tokens=120, blocks_used=5, bytes_used=5 * 4096)
    stats["b"] = dict(hit_tokens=1, queried_tokens=4, blocks_used=1, blocks_capacity=2, bytes_used=8, bytes_budget=16)
    seen = _samples(metrics)
    assert seen[("llm_prefix_cache_hits_total", a)] == 30
    assert seen[("llm_prefix_cache_queries_total", a)] == 120
    assert seen[("llm_prefix_cache_hit_rate", a)] == 0.25
    assert seen[("llm_prefix_cache_blocks_used", a)] == 5 and seen[("llm_prefix_cache_blocks_capacity", a)] == 64
    assert seen[("llm_prefix_cache_bytes_used", a)] == 20480 and seen[("llm_prefix_cache_bytes_budget", a)] == 1 << 20
    assert seen[("llm_prefix_cache_hit_rate", (("model_name", "b"),))] == 0.25
    assert not any(name.startswith("llm_prefix") for name, _ in _samples(ServeMetrics({})))   # none given


def test_each_app_counts_in_its_own_registry():
    one, two = ServeMetrics({}), ServeMetrics({})
    one.refused(429, "rate_limit_exceeded")
    one.refused(429, "rate_limit_exceeded")
    key = ("llm_request_errors_total", (("code", "rate_limit_exceeded"), ("status", "429")))
    assert _samples(one)[key] == 2 and key not in _samples(two)
    assert not [f.name for f in prometheus_client.REGISTRY.collect() if f.name.startswith("llm_")]
