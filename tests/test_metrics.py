"""utils/serve/metrics.py in-process: a prefix cache's ``stats()`` as Prometheus series (read
from the lane at each scrape), and each app's own registry (nothing in prometheus_client's
global one). The live checks (exact counts after real requests through the official `openai`
client, /metrics behind the API key) are tests/test_serve.py's, on its module's server."""
from __future__ import annotations

import threading

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from utils.serve.metrics import ServeMetrics


def _samples(metrics: ServeMetrics) -> dict:
    body, kind = metrics.render()
    assert kind.startswith("text/plain; version=")
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(body.decode()) for x in family.samples}


def test_prefix_cache_series_are_the_engine_store_s_own_stats():
    """A real engine loop with a prefix cache: after two requests with the same prompt (the
    second finds the first's blocks), the series are the store's stats() as the lane reports
    them: hit and queried tokens, the hit rate, evictions, blocks and bytes."""
    from tests.conftest import spm_tokenizer
    from tests.test_structured import _tiny
    from utils.generation.engine import Engine, SamplingParams, Sequence
    from utils.generation.loop import EngineLoop
    from utils.serve.served import ServedModel
    tok = spm_tokenizer()
    engine = Engine(_tiny(tok))
    assert engine.use_prefix_cache(1 << 20, block_tokens=4) is None
    loop = EngineLoop().start()
    try:
        lane = loop.add(engine, slots=2)
        metrics = ServeMetrics({"m": ServedModel("m", tok, "pretrain", None, lane, 0)})
        for _ in range(2):
            done = threading.Event()
            lane.submit(Sequence([tok.bos_token_id] + list(range(20, 33)), SamplingParams(3, 0.0), tok=tok,
                                 sink=lambda e: e.finish is not None and done.set()))
            assert done.wait(30)
        seen, stats = _samples(metrics), lane.prefix_cache
    finally:
        loop.stop()
    m = (("model_name", "m"),)
    assert stats["hit_tokens"] > 0 and stats["blocks_used"] > 0
    assert seen[("llm_prefix_cache_hits_total", m)] == stats["hit_tokens"]
    assert seen[("llm_prefix_cache_queries_total", m)] == stats["queried_tokens"]
    assert seen[("llm_prefix_cache_hit_rate", m)] == stats["hit_tokens"] / stats["queried_tokens"]
    assert seen[("llm_prefix_cache_evicted_blocks_total", m)] == stats["evicted_blocks"]
    for key in ("blocks_used", "blocks_capacity", "bytes_used", "bytes_budget"):
        assert seen[(f"llm_prefix_cache_{key}", m)] == stats[key], key
    assert not any(name.startswith("llm_prefix") for name, _ in _samples(ServeMetrics({})))   # none: none shown


def test_each_app_counts_in_its_own_registry():
    one, two = ServeMetrics({}), ServeMetrics({})
    one.refused(429, "rate_limit_exceeded")
    one.refused(429, "rate_limit_exceeded")
    key = ("llm_request_errors_total", (("code", "rate_limit_exceeded"), ("status", "429")))
    assert _samples(one)[key] == 2 and key not in _samples(two)
    assert not [f.name for f in prometheus_client.REGISTRY.collect() if f.name.startswith("llm_")]
