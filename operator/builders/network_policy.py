"""The NetworkPolicy of a service's engine pods: only its own router, its own engines and its scrapers in.

The internal key guards the engine port's routes, but not everything listens there: a prefill's bootstrap
server, the KV side channel and Mooncake's transfer ports take requests from any decode that knows them.
The router pods are not selected: their Service stays reachable as the spec says. Kubelet probes come
from the node, which NetworkPolicies always let in.
"""
from __future__ import annotations

import copy
from typing import Any

from baton.operator import naming
from baton.operator.builders.common import metadata
from baton.operator.naming import Role
from baton.operator.spec import InferenceService

# The Prometheus Operator labels the pods of every Prometheus it runs so (spec.monitoring makes its objects).
PROMETHEUS_PODS = {"namespaceSelector": {},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def _engine_pods(isvc: InferenceService) -> dict[str, Any]:
    # every engine role, not only the mode's: during a mode switch the old roles still serve and transfer
    return {"matchLabels": {naming.SERVICE_LABEL: isvc.name},
            "matchExpressions": [{"key": naming.ROLE_LABEL, "operator": "In",
                                  "values": [r.value for r in naming.ENGINE_ROLES]}]}


def _scrapers(isvc: InferenceService, operator_namespace: str | None) -> list[dict[str, Any]]:
    """Who reads /metrics: the operator's planner (from its pod; None: it runs outside the cluster) and
    spec.networkPolicy.metricsFrom, or Prometheus by default when monitoring is on."""
    peers = []
    if isvc.spec.planner is not None and operator_namespace:
        peers.append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": operator_namespace}},
                      "podSelector": {"matchLabels": {"app.kubernetes.io/name": naming.OPERATOR_NAME}}})
    given, mon = isvc.spec.network_policy.metrics_from, isvc.spec.monitoring
    if given is not None:
        peers += copy.deepcopy(given)
    elif mon.pod_monitor or mon.service_monitor:
        peers.append(copy.deepcopy(PROMETHEUS_PODS))
    return peers


def engine_network_policy(isvc: InferenceService, operator_namespace: str | None = None) -> dict[str, Any]:
    engine_port = [{"protocol": "TCP", "port": naming.ENGINE_PORT}]
    router = {"podSelector": {"matchLabels": naming.selector_labels(isvc.name, Role.ROUTER)}}
    ingress: list[dict[str, Any]] = [
        {"from": [router], "ports": copy.deepcopy(engine_port)},
        # PD between the service's engines: the bootstrap port, and the KV side channel and Mooncake ports,
        # which each engine picks at random when it starts, so no port list
        {"from": [{"podSelector": _engine_pods(isvc)}]},
    ]
    scrapers = _scrapers(isvc, operator_namespace)
    if scrapers:
        ingress.append({"from": scrapers, "ports": copy.deepcopy(engine_port)})
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(isvc, naming.engine_network_policy(isvc.name)),
            "spec": {"podSelector": _engine_pods(isvc), "policyTypes": ["Ingress"], "ingress": ingress}}
