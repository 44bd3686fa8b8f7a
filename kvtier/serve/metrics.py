"""GET /metrics: Prometheus text, named like vLLM's metrics where one exists (kvtier: prefix).

Latencies are histograms observed by the engine thread as tokens appear (prometheus-client
is thread-safe). Everything that is state (requests running and waiting, KV pages in use,
the store's bytes, blocks, evictions, pins, verification failures) is read when scraped,
from the engine and `store.stats()`, so it cannot drift from the truth. Each server has
its own CollectorRegistry: two servers in one process (tests) never mix their numbers.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtier.serve.protocol import TIERS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REASONS = ("length", "stop", "abort", "error")     # kvtier:request_success_total{finished_reason}
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class ServeMetrics:
    """The server's registry; also the engine loop's Observer."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        label = {"model_name": model}
        r = self.registry
        self._ttft = Histogram("kvtier:time_to_first_token_seconds", "Seconds from arrival to the first token.",
                               ["model_name"], buckets=_LATENCY, registry=r).labels(**label)
        self._itl = Histogram("kvtier:inter_token_latency_seconds", "Seconds between a request's tokens.",
                              ["model_name"], buckets=_LATENCY, registry=r).labels(**label)
        self._e2e = Histogram("kvtier:e2e_request_latency_seconds", "Seconds from arrival to the last token.",
                              ["model_name"], buckets=_E2E, registry=r).labels(**label)
        self._queries = Counter("kvtier:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                ["model_name"], registry=r).labels(**label)
        hits = Counter("kvtier:prefix_cache_hits", "Prompt tokens served from the cache, by the tier they came from.",
                       ["model_name", "tier"], registry=r)
        self._hits = {t: hits.labels(model, t) for t in TIERS}
        self._model = model
        self._requests = Counter("kvtier:request_success", "Finished requests, by finish reason.",
                                 ["model_name", "finished_reason"], registry=r)
        for reason in REASONS:              # every series from the start (a rate needs it)
            self._requests.labels(model, reason)

    def attach(self, engine: Any) -> None:
        """Read engine and store state at scrape time (engine: an EngineLoop)."""
        self.registry.register(_StateCollector(engine, self._model))

    # -- Observer -------------------------------------------------------------------------
    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, seconds: float, prompt_tokens: int, cached_by_tier: dict[str, int]) -> None:
        self._e2e.observe(seconds)
        self._queries.inc(prompt_tokens)
        for tier, n in cached_by_tier.items():
            key = tier if tier in self._hits else "remote"
            self._hits[key].inc(n)

    def outcome(self, reason: str) -> None:
        self._requests.labels(self._model, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges and counters read from the engine and its store when /metrics is scraped."""

    def __init__(self, engine: Any, model: str) -> None:
        self.engine = engine
        self.model = model

    def describe(self) -> list:
        return []                                   # collected lazily (no registration-time scrape)

    def collect(self) -> Iterator[Metric]:
        m = self.model
        running, waiting = self.engine.counts()
        yield _gauge("kvtier:num_requests_running", "Requests in the engine's running batch.", m, running)
        yield _gauge("kvtier:num_requests_waiting", "Requests waiting to be admitted.", m, waiting)
        llm = self.engine.llm
        if llm is None:
            return
        store = llm.store
        capacity = llm.request_pages
        in_use = llm.pages_in_use
        yield _gauge("kvtier:kv_cache_usage_perc", "Share of KV pages held by requests (1 = full).", m,
                     in_use / capacity if capacity else 0.0)
        yield _gauge("kvtier:kv_pages_in_use", "KV pages held by requests (owned or referenced).", m, in_use)
        st = store.stats()
        per_tier: list[tuple[str, str, Callable[[Any], float], type]] = [
            ("kvtier:store_used_bytes", "Bytes of cached blocks in each tier.", lambda t: t.used_bytes, GaugeMetricFamily),
            ("kvtier:store_capacity_bytes", "Capacity of each tier in bytes.", lambda t: t.capacity_bytes,
             GaugeMetricFamily),
            ("kvtier:store_used_blocks", "Cached blocks in each tier.", lambda t: t.used_blocks, GaugeMetricFamily),
            ("kvtier:store_pinned_bytes", "Bytes pinned by sessions in each tier.", lambda t: t.pinned_bytes,
             GaugeMetricFamily),
            ("kvtier:store_evictions", "Blocks evicted from each tier to make room.", lambda t: t.evicted,
             CounterMetricFamily),
            ("kvtier:store_hits", "Blocks read from each tier.", lambda t: t.hits, CounterMetricFamily),
        ]
        for name, doc, value, kind in per_tier:
            fam = kind(name, doc, labels=["model_name", "tier"])
            for t in st.tiers:
                fam.add_metric([m, t.name], value(t))
            yield fam
        c = st.counters
        yield _counter("kvtier:store_verification_failures", "Blocks that failed checksum verification on read.",
                       m, c.corrupt_blocks)
        yield _counter("kvtier:store_remote_blocks", "Blocks fetched from peers.", m, c.remote_blocks)
        yield _gauge("kvtier:store_pinned_sessions", "Sessions holding a pin.", m, st.pinned_sessions)
        yield _counter("kvtier:store_pins_shed", "Session pins dropped before their expiry to bound the pins' memory.",
                       m, st.pins_shed)
        if llm.speculative is not None:                   # vLLM's spec_decode counters
            sp = llm.spec_stats
            yield _counter("kvtier:spec_decode_num_drafts", "Verify steps with at least one draft token.", m, sp.drafts)
            yield _counter("kvtier:spec_decode_num_draft_tokens", "Draft tokens proposed.", m, sp.draft_tokens)
            yield _counter("kvtier:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m, sp.accepted_tokens)
            fam = CounterMetricFamily("kvtier:spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts whose token at this position was accepted.", labels=["model_name", "position"])
            for i, n in enumerate(list(sp.accepted_per_position)):
                fam.add_metric([m, str(i)], n)
            yield fam


def _gauge(name: str, doc: str, model: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric([model], value)
    return g


def _counter(name: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["model_name"])
    c.add_metric([model], value)
    return c
