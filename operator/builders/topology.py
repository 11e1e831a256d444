"""A ConfigMap describing what the operator runs: roles, selectors, ports, commands.

Nothing mounts it (so it never rolls pods); it is for people and tools (benchmarks, e2e) that want to
find the router endpoint and each role's pods without knowing the operator's naming rules.
"""
from __future__ import annotations

import json
from typing import Any

from baton.operator import naming
from baton.operator.builders.common import metadata
from baton.operator.builders.engine import engine_args
from baton.operator.builders.router import router_args
from baton.operator.naming import Role
from baton.operator.spec import InferenceService


def endpoint_url(isvc: InferenceService) -> str:
    host = naming.router_service_host(isvc.name, isvc.namespace)
    return f"http://{host}:{isvc.spec.router.service_port}"


def topology(isvc: InferenceService) -> dict[str, Any]:
    roles: dict[str, Any] = {}
    for role, r in isvc.spec.roles.items():
        roles[role.value] = {"deployment": naming.child_name(isvc.name, role),
                             "selector": naming.selector_labels(isvc.name, role),
                             "replicas": r.replicas, "port": naming.ENGINE_PORT,
                             "command": ["baton", "serve", *engine_args(isvc, role)]}
        if role is Role.PREFILL:
            roles[role.value]["bootstrapPort"] = isvc.spec.kv_transfer.bootstrap_port
    return {"mode": isvc.spec.mode.value, "model": isvc.spec.model.name, "endpoint": endpoint_url(isvc),
            "roles": roles,
            "router": {"deployment": naming.child_name(isvc.name, Role.ROUTER),
                       "selector": naming.selector_labels(isvc.name, Role.ROUTER),
                       "command": ["baton", "router", *router_args(isvc)]}}


def topology_config_map(isvc: InferenceService) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(isvc, f"{isvc.name}-topology"),
            "data": {"topology.json": json.dumps(topology(isvc), indent=2, sort_keys=True)}}
