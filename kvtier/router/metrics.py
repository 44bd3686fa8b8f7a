"""The router's GET /metrics: Prometheus text (prefix kvtier_router:).

Requests are counted as they end, by route (completions, chat) and outcome: disaggregated
(prefilled on a prefill worker, decoded on another), direct (straight to a decode worker),
rejected (a 4xx: a bad request), unserved (a 5xx: no worker could serve), abandoned (the
client disconnected before its answer started: the workers' calls were cancelled). Everything else is
read when scraped from the router's own state, so it cannot drift: per worker its status,
the outstanding load the router counts (prefill tokens, decode requests and blocks), calls
that failed, and the KV it handed over as the worker reports it (bytes pulled by decode
workers, pushed by prefill workers, from their /kvtier/load); the retry counters. One
CollectorRegistry per router, so two routers in one process never mix their numbers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from kvtier.router.app import Router

OUTCOMES = ("disaggregated", "direct", "rejected", "unserved", "abandoned")


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter("kvtier_router:requests", "Generation requests, by route and outcome.",
                                 ["route", "outcome"], registry=self.registry)
        for route in ("completions", "chat"):        # every series exists from the start (rates need it)
            for outcome in OUTCOMES:
                self._requests.labels(route, outcome)

    def attach(self, router: Router) -> None:
        self.registry.register(_RouterState(router))

    def request(self, route: str, outcome: str) -> None:
        self._requests.labels(route, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RouterState:
    """Per-worker gauges and counters, and the router's retry counts, read at scrape time."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Metric]:
        workers = self.router.pools.all
        per_worker = [
            ("kvtier_router:worker_up", "1 if the worker is ready (in rotation), else 0.", GaugeMetricFamily,
             lambda w: float(w.ready)),
            ("kvtier_router:worker_prefill_tokens", "Prompt tokens the router sent the worker, not computed yet.",
             GaugeMetricFamily, lambda w: w.prefill_tokens),
            ("kvtier_router:worker_decode_requests", "Requests streaming from the worker.", GaugeMetricFamily,
             lambda w: w.decode_seqs),
            ("kvtier_router:worker_decode_blocks", "KV blocks of the requests streaming from the worker.",
             GaugeMetricFamily, lambda w: w.decode_blocks),
            ("kvtier_router:worker_failures", "Calls to the worker that failed (connection, 5xx).",
             CounterMetricFamily, lambda w: w.failures),
        ]
        for name, doc, kind, value in per_worker:
            fam = kind(name, doc, labels=["worker", "pool"])
            for w in workers:
                fam.add_metric([w.url, w.pool], value(w))
            yield fam
        moved = CounterMetricFamily("kvtier_router:handoff_bytes", "KV bytes handed over, as each worker reports "
                                    "them: pulled (by a decode worker) or pushed (by a prefill worker).",
                                    labels=["worker", "direction"])
        for w in workers:
            moved.add_metric([w.url, "pulled"], w.pulled_bytes)
            moved.add_metric([w.url, "pushed"], w.pushed_bytes)
        yield moved
        s = self.router.stats
        for name, doc, value in (
                ("kvtier_router:prefill_retries", "Prefills retried on another worker (or left to the decode worker).",
                 s.prefill_retries),
                ("kvtier_router:decode_retries", "Requests sent to another decode worker before any answer.",
                 s.decode_retries),
                ("kvtier_router:streams_cut", "Streamed answers ended by an error chunk: the decode worker went "
                 "away mid-answer.", s.cut)):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c
