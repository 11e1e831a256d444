"""Prometheus Operator objects (monitoring.coreos.com/v1) scraping `/metrics` of engines and router."""
from __future__ import annotations

from typing import Any

from baton.operator import naming
from baton.operator.builders.common import metadata
from baton.operator.spec import InferenceService

MONITORING_API = "monitoring.coreos.com/v1"


def _meta(isvc: InferenceService) -> dict[str, Any]:
    meta = metadata(isvc, isvc.name)
    meta["labels"].update(isvc.spec.monitoring.labels)
    return meta


def _endpoint(isvc: InferenceService) -> dict[str, Any]:
    return {"port": "http", "path": "/metrics", "interval": isvc.spec.monitoring.interval,
            # dashboards and alerts select on inference_service (docs/observability.md)
            "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_baton_dev_inference_service"],
                             "targetLabel": "inference_service", "action": "replace"}]}


def pod_monitor(isvc: InferenceService) -> dict[str, Any]:
    return {"apiVersion": MONITORING_API, "kind": "PodMonitor", "metadata": _meta(isvc),
            "spec": {"selector": {"matchLabels": {naming.SERVICE_LABEL: isvc.name}},
                     "podMetricsEndpoints": [_endpoint(isvc)]}}


def service_monitor(isvc: InferenceService) -> dict[str, Any]:
    return {"apiVersion": MONITORING_API, "kind": "ServiceMonitor", "metadata": _meta(isvc),
            "spec": {"selector": {"matchLabels": {naming.SERVICE_LABEL: isvc.name,
                                                  naming.MANAGED_BY_LABEL: naming.OPERATOR_NAME}},
                     "endpoints": [_endpoint(isvc)]}}
