"""The router (`baton router --service-discovery`): Deployment, Service and its least-privilege RBAC."""
from __future__ import annotations

import copy
from typing import Any

from baton.operator import naming
from baton.operator.builders.common import (container_security_context, http_probe, metadata,
                                            placement_fields, pod_security_context, resources,
                                            spread_over_nodes, tcp_probe)
from baton.operator.builders.engine import PRESTOP_SECONDS
from baton.operator.builders.internal_key import ROUTER_KEY_ENV, internal_key_env
from baton.operator.naming import Role
from baton.operator.spec import InferenceService

API_KEY_ENV = "BATON_API_KEY"


def _selector_args(flag: str, labels: dict[str, str]) -> list[str]:
    return [flag, *(f"{k}={v}" for k, v in labels.items())]


def router_args(isvc: InferenceService) -> list[str]:
    """Arguments of `baton router`; the selectors are the engine pods' role labels."""
    spec, r = isvc.spec, isvc.spec.router
    args = ["--host", "0.0.0.0", "--port", str(naming.ROUTER_PORT)]
    if spec.disaggregated:
        args += ["--pd-disaggregation", "--service-discovery",
                 *_selector_args("--prefill-selector", naming.selector_labels(isvc.name, Role.PREFILL)),
                 *_selector_args("--decode-selector", naming.selector_labels(isvc.name, Role.DECODE))]
    else:
        args += ["--service-discovery",
                 *_selector_args("--selector", naming.selector_labels(isvc.name, Role.COLOCATED))]
    args += ["--service-discovery-namespace", isvc.namespace,
             "--service-discovery-port", str(naming.ENGINE_PORT)]
    if spec.disaggregated:
        args += ["--prefill-policy", r.prefill_policy, "--decode-policy", r.decode_policy]
    else:
        args += ["--policy", r.policy]
    # the relays in flight at SIGTERM finish as long as the engines may take for theirs (the pod's grace
    # period is that plus the preStop sleep)
    args += ["--shutdown-timeout-secs", str(max(x.termination_grace_seconds for x in spec.roles.values()))]
    return args + list(r.extra_args)


def _env(isvc: InferenceService) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    key = isvc.spec.router.api_key
    if key is not None:  # never an argument: it would show in `ps` and in the Deployment
        env.append({"name": API_KEY_ENV,
                    "valueFrom": {"secretKeyRef": {"name": key.name, "key": key.key}}})
    env.append(internal_key_env(isvc, ROUTER_KEY_ENV))  # what it sends the engines: not the clients' key
    return env + copy.deepcopy(isvc.spec.router.env)


def router_deployment(isvc: InferenceService) -> dict[str, Any]:
    spec, r = isvc.spec, isvc.spec.router
    name = naming.child_name(isvc.name, Role.ROUTER)
    container = {
        "name": "router", "image": r.image or spec.image, "imagePullPolicy": spec.image_pull_policy,
        "command": ["baton", "router"], "args": router_args(isvc),
        "ports": [{"name": "http", "containerPort": naming.ROUTER_PORT, "protocol": "TCP"}],
        "env": _env(isvc), "resources": resources(r.resources, {}),
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
        "readinessProbe": http_probe("http", "/health", 5, 3),
        "livenessProbe": tcp_probe("http", 10, 6),
        # out of the Service before SIGTERM; then `baton router` stops listening and lets the requests it
        # relays finish (within the grace period: as long as an engine gives its own)
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "securityContext": container_security_context(read_only_root=True),
    }
    pod: dict[str, Any] = {
        "serviceAccountName": name, "automountServiceAccountToken": True, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": PRESTOP_SECONDS + max(x.termination_grace_seconds
                                                               for x in spec.roles.values()),
        "containers": [container], "volumes": [{"name": "tmp", "emptyDir": {}}],
        "securityContext": pod_security_context(spec.pod_security),
        **placement_fields(r.placement.node_selector, r.placement.tolerations, r.placement.affinity,
                           spread_over_nodes(isvc, Role.ROUTER) if r.placement.topology_spread is None
                           else r.placement.topology_spread),
    }
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(isvc, name, Role.ROUTER),
        "spec": {
            "replicas": r.replicas,
            "selector": {"matchLabels": naming.selector_labels(isvc.name, Role.ROUTER)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": naming.common_labels(isvc.name, Role.ROUTER),
                             "annotations": {"prometheus.io/scrape": "true",
                                             "prometheus.io/port": str(naming.ROUTER_PORT),
                                             "prometheus.io/path": "/metrics"}},
                "spec": pod,
            },
        },
    }


def router_service(isvc: InferenceService) -> dict[str, Any]:
    r = isvc.spec.router
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(isvc, naming.child_name(isvc.name, Role.ROUTER), Role.ROUTER),
        "spec": {"type": r.service_type, "selector": naming.selector_labels(isvc.name, Role.ROUTER),
                 "ports": [{"name": "http", "port": r.service_port, "targetPort": "http",
                            "protocol": "TCP"}]},
    }


def router_service_account(isvc: InferenceService) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": metadata(isvc, naming.child_name(isvc.name, Role.ROUTER), Role.ROUTER)}


# The router discovers engine pods by label; it needs nothing else from the API.
ROUTER_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]


def router_role(isvc: InferenceService) -> dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": metadata(isvc, naming.child_name(isvc.name, Role.ROUTER), Role.ROUTER),
            "rules": copy.deepcopy(ROUTER_RULES)}


def router_role_binding(isvc: InferenceService) -> dict[str, Any]:
    name = naming.child_name(isvc.name, Role.ROUTER)
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": metadata(isvc, name, Role.ROUTER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}]}
