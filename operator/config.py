"""Configuration of one running operator (from the CLI; handed to handlers through kopf's memo)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from baton.operator.scrape import pod_metrics_url


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = 60.0  # full reconcile + status refresh of every InferenceService
    retry_seconds: float = 10.0  # back-off after a temporary error (API conflict, 5xx, RBAC)
    metrics_port: int | None = 9090  # None: no metrics server; 0: any free port
    metrics_addr: str = "0.0.0.0"
    post_events: bool = True  # Kubernetes Events for handler results (kopf's posting)
    # where the planner reads a pod's /metrics: its IP and the engine port (tests running engines on
    # loopback next to fake nodes give their own)
    metrics_url: Callable[[Mapping[str, Any]], str | None] = pod_metrics_url
    # the planner reads services with `monitoring` on from this Prometheus (None: it scrapes every pod)
    prometheus_url: str | None = None
    # where the operator's pod runs ($POD_NAMESPACE; None outside a cluster): the engines' NetworkPolicies
    # let its pods in, for the planner's scrapes
    operator_namespace: str | None = None

    def __post_init__(self) -> None:
        assert self.resync_seconds > 0 and self.retry_seconds > 0
        assert self.metrics_port is None or 0 <= self.metrics_port < 65536
