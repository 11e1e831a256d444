"""Pure builders: InferenceService -> the Kubernetes objects (dicts) that serve it.

No I/O here; `baton.operator.reconciler` applies what `build_children` returns.
"""
from __future__ import annotations

from typing import Any

from baton.operator.builders.common import stamp
from baton.operator.builders.disruption import disruption_budget
from baton.operator.builders.engine import engine_deployment, engine_service
from baton.operator.builders.monitoring import pod_monitor, service_monitor
from baton.operator.builders.network_policy import engine_network_policy
from baton.operator.builders.router import (router_deployment, router_role, router_role_binding,
                                            router_service, router_service_account)
from baton.operator.builders.topology import endpoint_url, topology_config_map
from baton.operator.naming import Role
from baton.operator.spec import InferenceService

__all__ = ["build_children", "endpoint_url"]


def build_children(isvc: InferenceService, operator_namespace: str | None = None) -> list[dict[str, Any]]:
    """Every child object, in apply order (RBAC and the NetworkPolicy before the pods), each hash-stamped.
    `operator_namespace`: where the operator's pod runs (None: outside the cluster)."""
    objs = [router_service_account(isvc), router_role(isvc), router_role_binding(isvc),
            topology_config_map(isvc)]
    if isvc.spec.network_policy.enabled:
        objs.append(engine_network_policy(isvc, operator_namespace))
    for role in isvc.spec.roles:
        objs.append(engine_service(isvc, role))
    objs.append(router_service(isvc))
    for role in isvc.spec.roles:
        objs.append(engine_deployment(isvc, role))
    objs.append(router_deployment(isvc))
    objs += [disruption_budget(isvc, role) for role in [*isvc.spec.roles, Role.ROUTER]]
    if isvc.spec.monitoring.pod_monitor:
        objs.append(pod_monitor(isvc))
    if isvc.spec.monitoring.service_monitor:
        objs.append(service_monitor(isvc))
    return [stamp(o) for o in objs]
