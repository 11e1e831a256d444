"""Prometheus metrics of one router, in its own CollectorRegistry (no process-wide state).

Counters and histograms are updated on the hot path through label children cached per label set.
State that already lives in the worker registry (health, breaker state, in-flight counts) is not
mirrored into gauges per request: a collector reads it at scrape time. Counters start at 0 for every
route and known error reason (and per worker, once it is added), so alerts and dashboards have series
before the first event. docs/metrics.md lists every metric (tests/test_docs.py checks it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from baton.router.config import WorkerRole
from baton.router.request import Route

if TYPE_CHECKING:
    from baton.router.registry import WorkerRegistry
    from baton.router.worker import Worker

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0, 300.0, 600.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Error reasons known in advance (`status_NNN` ones appear when they happen).
ERROR_REASONS = ("bad_request", "payload_too_large", "queue_full", "queue_timeout", "no_workers", "timeout",
                 "transport", "stalled", "client_disconnected", "worker_auth", "aborted")


class RouterMetrics:
    def __init__(self, workers: "WorkerRegistry", router_state: Callable[[], dict[str, int]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("baton_router_requests", "Client requests received", ["route"], registry=r)
        self.errors = Counter("baton_router_errors", "Error responses sent to clients",
                              ["route", "reason"], registry=r)
        self.retries = Counter("baton_router_retries", "Retries (attempts after the first)", ["route"], registry=r)
        self.worker_requests = Counter("baton_router_worker_requests", "Requests sent to a worker",
                                       ["worker", "side", "route"], registry=r)
        self.worker_errors = Counter("baton_router_worker_errors", "Failed requests to a worker",
                                     ["worker", "side", "reason"], registry=r)
        self.ttft = Histogram("baton_router_ttft_seconds", "Arrival to first response byte sent (streaming)",
                              ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.latency = Histogram("baton_router_request_duration_seconds", "Arrival to last response byte",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.pd_pairs = Counter("baton_router_pd_pairs", "Prefill/decode pairs chosen", ["prefill", "decode"],
                                registry=r)
        self.decisions = Counter("baton_router_policy_decisions", "Policy picks by reason",
                                 ["side", "policy", "reason"], registry=r)
        self.aborts = Counter("baton_router_aborts", "Abort requests sent to workers", ["side"], registry=r)
        self.discovery_events = Counter("baton_router_discovery_events", "Workers added/removed by discovery",
                                        ["side", "event"], registry=r)
        self.registry.register(_StateCollector(workers, router_state))
        self._cache: dict[tuple, Any] = {}
        self._start_at_zero()
        workers.on_added.append(self._start_worker_at_zero)

    def _start_at_zero(self) -> None:
        for route in Route:
            for metric in (self.requests, self.retries, self.ttft, self.latency):
                self.child(metric, route.value)
            for reason in ERROR_REASONS:
                self.child(self.errors, route.value, reason)
        for side in (role.value for role in WorkerRole):
            self.child(self.aborts, side)
            for event in ("added", "removed"):
                self.child(self.discovery_events, side, event)

    def _start_worker_at_zero(self, worker: "Worker") -> None:
        for reason in ("transport", "stalled", "worker_auth"):
            self.child(self.worker_errors, worker.url, worker.side, reason)

    def child(self, metric: Any, *labels: str) -> Any:
        """The cached label child of `metric` (label lookups cost more than the update itself)."""
        key = (id(metric), labels)
        child = self._cache.get(key)
        if child is None:
            child = self._cache[key] = metric.labels(*labels)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self, workers: "WorkerRegistry", router_state: Callable[[], dict[str, int]]) -> None:
        self._workers = workers
        self._router_state = router_state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("baton_router_worker_healthy", "1 if the worker passes health checks",
                                    labels=["worker", "side"])
        breaker = GaugeMetricFamily("baton_router_circuit_breaker_state",
                                    "Circuit breaker: 0 closed, 1 open, 2 half-open", labels=["worker", "side"])
        in_flight = GaugeMetricFamily("baton_router_worker_in_flight", "Requests in flight to the worker",
                                      labels=["worker", "side"])
        rank = GaugeMetricFamily("baton_router_dp_rank_in_flight", "Requests in flight per DP rank (DP-aware)",
                                 labels=["worker", "side", "dp_rank"])
        for w in self._workers.workers():
            labels = [w.url, w.role.value]
            healthy.add_metric(labels, 1.0 if w.healthy else 0.0)
            breaker.add_metric(labels, float(w.breaker.state))
            in_flight.add_metric(labels, float(w.in_flight))
            for t in w.targets:
                if t.dp_rank is not None:
                    rank.add_metric(labels + [str(t.dp_rank)], float(t.in_flight))
        yield from (healthy, breaker, in_flight, rank)
        state = self._router_state()
        yield GaugeMetricFamily("baton_router_in_flight_requests", "Client requests being served",
                                value=state["in_flight"])
        yield GaugeMetricFamily("baton_router_queue_depth", "Client requests waiting for a slot",
                                value=state["queued"])
