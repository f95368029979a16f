"""The Prometheus metrics of ``serve`` at ``GET /metrics`` (library; no side effects: each app
has its own ``CollectorRegistry``, nothing is registered in prometheus_client's global one).

    metrics = ServeMetrics(models)       models: id -> ServedModel (its lane's figures are read per scrape)
    metrics.request_ended(job)          once per admitted request, as it ends (utils/serve/job.py)
    metrics.refused(status, code)       once per request answered with an ApiError
    body, content_type = metrics.render()

Names: vLLM's where they mean the same, with ``llm_`` for ``vllm:`` (a colon is for recording
rules in Prometheus' conventions); every series carries ``model_name`` where it is a model's.

- ``llm_request_success_total{finished_reason}``: choices (sequences: a request of ``n``
  choices counts n) by how they ended: stop, length, abort (the client left, or the server
  stopped), error (the engine failed). ``llm_request_errors_total{status,code}``: requests
  answered with an OpenAI error body (401s of the key check are answered before the app).
- ``llm_prompt_tokens_total``, ``llm_generation_tokens_total``: as the requests' usage counts them.
- ``llm_time_to_first_token_seconds``: per request, from its arrival to its first token.
  ``llm_inter_token_latency_seconds``: each token after a choice's first, observed with its
  request's mean gap (the time from the first token to the end over those tokens), since tokens
  reach the HTTP process in groups (serve.stream_interval) whose own gaps say nothing; counted
  in one step per choice (a weighted observation), never once per token on the event loop.
  ``llm_e2e_request_latency_seconds``: arrival to end.
- Read at each scrape: ``llm_num_requests_running`` / ``llm_num_requests_waiting`` (sequences
  in the batch / queued), ``llm_kv_cache_slots_used`` / ``llm_kv_cache_slots_total``, their
  ratio ``llm_kv_cache_usage_perc`` (0..1, as vLLM's), ``llm_kv_cache_bytes_used`` /
  ``llm_kv_cache_bytes_total`` (a slot holds the whole context: slots x bytes per slot).
- Prefix cache, of each model whose lane has one (``lane.prefix_cache``: the store's
  ``stats()``, utils/generation/prefix_cache.py, as of the engine's last pass): its cumulative
  ``hit_tokens`` and ``queried_tokens`` as ``llm_prefix_cache_hits_total`` and
  ``llm_prefix_cache_queries_total`` (vLLM's pair, in tokens: ``rate(hits) / rate(queries)`` is
  the hit rate), ``llm_prefix_cache_evicted_blocks_total``, ``llm_prefix_cache_hit_rate``
  (since start) and the gauges ``llm_prefix_cache_blocks_used``, ``_blocks_capacity``,
  ``_bytes_used``, ``_bytes_budget``.
"""
from __future__ import annotations

import bisect
import time
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}
PREFIX_GAUGES = ("blocks_used", "blocks_capacity", "bytes_used", "bytes_budget")   # of a store's stats()


class ServeMetrics:
    """The app's registry: request counters and histograms fed as requests end, and the
    batch, KV-cache and prefix-cache figures read at each scrape."""

    def __init__(self, models: dict):
        self.registry = r = CollectorRegistry()
        model = ["model_name"]
        self.success = Counter("llm_request_success", "Choices finished, by finish reason (stop, length, "
                               "abort, error).", model + ["finished_reason"], registry=r)
        self.errors = Counter("llm_request_errors", "Requests answered with an error body, by HTTP "
                              "status and error code.", ["status", "code"], registry=r)
        self.prompt_tokens = Counter("llm_prompt_tokens", "Prompt tokens of finished requests.", model, registry=r)
        self.generation_tokens = Counter("llm_generation_tokens", "Generated tokens.", model, registry=r)
        self.ttft = Histogram("llm_time_to_first_token_seconds", "Time from a request's arrival to its "
                              "first token.", model, buckets=TTFT_BUCKETS, registry=r)
        self.itl = _WeightedHistogram("llm_inter_token_latency_seconds", "Time per token after a choice's "
                                      "first (its request's mean).", ITL_BUCKETS)
        r.register(self.itl)
        self.e2e = Histogram("llm_e2e_request_latency_seconds", "Time from a request's arrival to its "
                             "end.", model, buckets=E2E_BUCKETS, registry=r)
        r.register(_LiveCollector(models))

    def request_ended(self, job) -> None:
        """Count one admitted request (a utils/serve/job.py Job) as it ends."""
        name = job.m.id
        ended = time.perf_counter() - job.t0
        for seq, finish in zip(job.seqs, job.finish):
            why = REASONS.get(finish or ("cancelled" if seq.cancelled else "error"), "error")
            self.success.labels(name, why).inc()
        self.prompt_tokens.labels(name).inc(job.prompt_tokens)
        self.generation_tokens.labels(name).inc(sum(len(s.tokens) for s in job.seqs))
        self.e2e.labels(name).observe(ended)
        if job.ttft is None:
            return
        self.ttft.labels(name).observe(job.ttft)
        for seq in job.seqs:            # one observation of weight n - 1, not n - 1 on the event loop
            if len(seq.tokens) > 1:
                self.itl.observe(name, (ended - job.ttft) / (len(seq.tokens) - 1), len(seq.tokens) - 1)

    def refused(self, status: int, code: Optional[str]) -> None:
        self.errors.labels(str(status), code or "none").inc()

    def render(self) -> tuple[bytes, str]:
        """The text exposition format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _WeightedHistogram:
    """A Prometheus histogram per model that takes one value ``times`` times in one step (the
    client library's Histogram observes one value per call: a request of 100,000 tokens was
    100,000 calls on the event loop). Exposed exactly as a Histogram of those observations."""

    def __init__(self, name: str, documentation: str, buckets: tuple):
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets) + [float("inf")]
        self.series: dict[str, tuple[list, list]] = {}    # model -> (counts per bucket, [sum])

    def observe(self, model: str, value: float, times: int = 1) -> None:
        counts, total = self.series.setdefault(model, ([0] * len(self.bounds), [0.0]))
        counts[bisect.bisect_left(self.bounds, value)] += times
        total[0] += value * times

    def collect(self):
        h = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        for model, (counts, total) in self.series.items():
            running, buckets = 0, []
            for bound, n in zip(self.bounds, counts):
                running += n
                buckets.append(("+Inf" if bound == float("inf") else floatToGoString(bound), running))
            h.add_metric([model], buckets, total[0])
        yield h


class _LiveCollector:
    """The figures read at each scrape from the models' lanes (their prefix caches' too)."""

    def __init__(self, models: dict):
        self.models = models

    def collect(self):
        gauges = {name: GaugeMetricFamily(f"llm_{name}", text, labels=["model_name"]) for name, text in (
            ("num_requests_running", "Sequences in the running batch."),
            ("num_requests_waiting", "Sequences queued for a slot."),
            ("kv_cache_slots_used", "KV-cache slots holding a sequence."),
            ("kv_cache_slots_total", "KV-cache slots (serve.max_batch)."),
            ("kv_cache_usage_perc", "KV-cache slots in use, 0..1."),
            ("kv_cache_bytes_used", "Bytes of the KV-cache slots in use."),
            ("kv_cache_bytes_total", "Bytes of all KV-cache slots."))}
        for mid, m in self.models.items():
            lane = m.lane
            running, slots = lane.running, lane.slots
            for name, value in (("num_requests_running", running),
                                ("num_requests_waiting", max(0, lane.active - running)),
                                ("kv_cache_slots_used", running), ("kv_cache_slots_total", slots),
                                ("kv_cache_usage_perc", running / slots),
                                ("kv_cache_bytes_used", running * lane.bytes_per_slot),
                                ("kv_cache_bytes_total", slots * lane.bytes_per_slot)):
                gauges[name].add_metric([mid], value)
        yield from gauges.values()
        cached = {mid: s for mid, m in self.models.items() if (s := getattr(m.lane, "prefix_cache", None))}
        if cached:
            yield from prefix_families(cached)


def prefix_families(stats: dict) -> list:
    """The prefix-cache series of ``{model id: stats dict}`` (see the module docstring)."""
    hits = CounterMetricFamily("llm_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                               labels=["model_name"])
    queries = CounterMetricFamily("llm_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                  "cache.", labels=["model_name"])
    evicted = CounterMetricFamily("llm_prefix_cache_evicted_blocks", "Blocks evicted from the prefix "
                                  "cache (least recently used first).", labels=["model_name"])
    rate = GaugeMetricFamily("llm_prefix_cache_hit_rate", "Hit tokens over queried tokens since start "
                             "(0 before any query).", labels=["model_name"])
    gauges = [GaugeMetricFamily(f"llm_prefix_cache_{key}", f"The prefix cache's {key.replace('_', ' ')}.",
                                labels=["model_name"]) for key in PREFIX_GAUGES]
    for mid, s in stats.items():
        hits.add_metric([mid], s["hit_tokens"])
        queries.add_metric([mid], s["queried_tokens"])
        evicted.add_metric([mid], s["evicted_blocks"])
        rate.add_metric([mid], s["hit_tokens"] / s["queried_tokens"] if s["queried_tokens"] else 0.0)
        for g, key in zip(gauges, PREFIX_GAUGES):
            g.add_metric([mid], s[key])
    return [hits, queries, evicted, rate, *gauges]
