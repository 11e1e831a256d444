"""The operator's own Prometheus metrics (prefix `baton_operator_`), on a registry of its own.

Listed with their meaning in docs/metrics.md (tests/test_docs.py checks it). One instance per running
operator, kept in kopf's memo. Labelled counters start at 0 for every known label value, so alerts and
dashboards have series before the first reconcile or error.
"""
from __future__ import annotations

from collections import Counter as Tally
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

TRIGGERS = ("create", "update", "resume", "resync", "child-deleted", "child-drifted")  # kopf's reasons and our own
RESULTS = ("ok", "error", "invalid")
ERROR_KINDS = ("invalid_spec", "name_taken", "permanent", "temporary", "status")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "baton_operator_reconciles", "Reconciles of InferenceServices by trigger and result.",
            ["trigger", "result"], registry=self.registry)
        self.errors = Counter(
            "baton_operator_errors", "Failed reconciles and status refreshes by error kind.",
            ["kind"], registry=self.registry)
        self.duration = Histogram(
            "baton_operator_reconcile_duration_seconds", "Time of one reconcile.", ["trigger"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=self.registry)
        self.managed = Gauge(
            "baton_operator_managed_objects", "Child objects the operator keeps in shape, by kind.",
            ["kind"], registry=self.registry)
        self.services = Gauge(
            "baton_operator_inference_services", "InferenceServices seen, by their Ready condition.",
            ["ready"], registry=self.registry)
        self._managed: dict[tuple[str, str], Tally[str]] = {}
        self._ready: dict[tuple[str, str], str] = {}
        for trigger in TRIGGERS:
            for result in RESULTS:
                self.reconciles.labels(trigger=trigger, result=result)
        for kind in ERROR_KINDS:
            self.errors.labels(kind=kind)
        self._publish()

    def set_managed(self, key: tuple[str, str], kinds: list[str]) -> None:
        self._managed[key] = Tally(kinds)
        self._publish()

    def set_ready(self, key: tuple[str, str], ready: str) -> None:
        self._ready[key] = ready
        self._publish()

    def forget(self, key: tuple[str, str]) -> None:
        self._managed.pop(key, None)
        self._ready.pop(key, None)
        self._publish()

    def _publish(self) -> None:
        total: Tally[str] = Tally()
        for tally in self._managed.values():
            total.update(tally)
        for kind in set(total) | {s.labels.get("kind", "") for m in self.managed.collect() for s in m.samples}:
            if kind:
                self.managed.labels(kind=kind).set(total.get(kind, 0))
        states = Tally(self._ready.values())
        for ready in ("True", "False", "Unknown"):
            self.services.labels(ready=ready).set(states.get(ready, 0))

    def serve(self, port: int, addr: str = "0.0.0.0") -> Any:
        """Serve /metrics in a thread; returns the HTTP server (its `server_port`, `shutdown()`)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0 when absent); for tests and debugging."""
        return self.registry.get_sample_value(name, labels) or 0.0
