"""Engine pods (`baton serve`): the prefill, decode or colocated Deployment and its headless Service."""
from __future__ import annotations

import copy
from typing import Any

from baton.operator import naming
from baton.operator.builders.common import (container_security_context, http_probe, metadata,
                                            placement_fields, pod_security_context, resources,
                                            spread_over_nodes, tcp_probe)
from baton.operator.builders.internal_key import ENGINE_KEY_ENV, internal_key_env
from baton.operator.builders.model_cache import cache_volume, engine_cache_mount, fetch_container
from baton.operator.builders.weights import PATH_ENV, VERSION_ENV, engine_version_env, in_place_fetch
from baton.operator.naming import Role
from baton.operator.spec import InferenceService, RoleSpec

MODEL_VOLUME = "model"
SHM_VOLUME = "dshm"
# Loading weights can take long; the startup probe allows this before liveness applies.
STARTUP_SECONDS = 1800
# preStop: the kubelet waits this long before SIGTERM, while the endpoints controller and the routers'
# discovery take the terminating pod out; the engine's own drain (SIGTERM) then finishes what it runs.
PRESTOP_SECONDS = 5
STARTUP_PERIOD = 10


def engine_args(isvc: InferenceService, role: Role) -> list[str]:
    """Arguments of `baton serve` for one engine role (the contract in ARCHITECTURE.md)."""
    spec, r = isvc.spec, isvc.spec.roles[role]
    # InPlace: the served version comes from the model ConfigMap (builders/weights.py), so a new source
    # changes no pod template
    path = f"$({PATH_ENV})" if spec.model.in_place else spec.model.path
    args = ["--model-path", path, "--host", "0.0.0.0", "--port", str(naming.ENGINE_PORT),
            "--served-model-name", spec.model.name, "--device", r.device,
            "--tp-size", str(r.tp), "--dp-size", str(r.dp)]
    # only when set: the engine's own default is auto, and unchanged args keep existing pods as they are
    if spec.model.in_place:
        args += ["--weight-version", f"$({VERSION_ENV})"]
    if spec.model.dtype != "auto":
        args += ["--dtype", spec.model.dtype]
    if spec.model.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", spec.model.kv_cache_dtype]
    if spec.model.tool_call_parser:
        args += ["--tool-call-parser", spec.model.tool_call_parser]
    if spec.model.reasoning_parser:
        args += ["--reasoning-parser", spec.model.reasoning_parser]
    if role in (Role.PREFILL, Role.DECODE):
        kv = spec.kv_transfer
        args += ["--disaggregation-mode", role.value,
                 "--disaggregation-bootstrap-port", str(kv.bootstrap_port),
                 "--disaggregation-transfer-backend", kv.backend,
                 "--disaggregation-protocol", kv.protocol]
        if kv.rdma and kv.ib_devices:
            args += ["--disaggregation-ib-device", ",".join(kv.ib_devices)]
    return args + list(r.extra_args)


def _ports(isvc: InferenceService, role: Role) -> list[dict[str, Any]]:
    ports = [{"name": "http", "containerPort": naming.ENGINE_PORT, "protocol": "TCP"}]
    if role is Role.PREFILL:
        ports.append({"name": "bootstrap", "containerPort": isvc.spec.kv_transfer.bootstrap_port,
                      "protocol": "TCP"})
    return ports


def _env(isvc: InferenceService, r: RoleSpec) -> list[dict[str, Any]]:
    def field_ref(name: str, path: str) -> dict[str, Any]:
        return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    own = [field_ref("POD_IP", "status.podIP"), field_ref("POD_NAME", "metadata.name"),
           field_ref("POD_NAMESPACE", "metadata.namespace"), internal_key_env(isvc, ENGINE_KEY_ENV)]
    if isvc.spec.model.in_place:
        own += engine_version_env(isvc)
    return own + copy.deepcopy(r.env)


def _volumes(isvc: InferenceService, r: RoleSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    model = isvc.spec.model
    volumes: list[dict[str, Any]] = []
    mounts: list[dict[str, Any]] = []
    # NCCL, gloo and the CPU TP all-reduce between the ranks of a pod go through /dev/shm, which is
    # 64 MiB in a container. A single rank does not need more: it gets the runtime's /dev/shm unless
    # shmSize asks otherwise.
    if r.ranks > 1 or r.shm_size is not None:
        shm: dict[str, Any] = {"medium": "Memory"}
        if r.shm_size is not None:
            shm["sizeLimit"] = r.shm_size
        volumes.append({"name": SHM_VOLUME, "emptyDir": shm})
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    if model.pvc_claim:
        volumes.append({"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": model.pvc_claim,
                                                                         "readOnly": True}})
        mount = {"name": MODEL_VOLUME, "mountPath": model.path, "readOnly": True}
        if model.pvc_sub_path:
            mount["subPath"] = model.pvc_sub_path
        mounts.append(mount)
    elif model.host_path:
        volumes.append({"name": MODEL_VOLUME, "hostPath": {"path": model.host_path, "type": "Directory"}})
        mounts.append({"name": MODEL_VOLUME, "mountPath": model.path, "readOnly": True})
    elif model.fetched:
        volumes.append(cache_volume(isvc))
        mounts.append(engine_cache_mount())
    return volumes, mounts


def _extended_resources(isvc: InferenceService, r: RoleSpec, role: Role) -> dict[str, int]:
    extra = {r.gpu_resource_name: r.gpus} if r.gpus else {}
    kv = isvc.spec.kv_transfer
    if role is not Role.COLOCATED and kv.rdma and kv.rdma_resource_name:
        extra[kv.rdma_resource_name] = kv.rdma_resource_count
    return extra


def _uses_rdma(isvc: InferenceService, role: Role) -> bool:
    return role is not Role.COLOCATED and isvc.spec.kv_transfer.rdma


def engine_container(isvc: InferenceService, role: Role) -> dict[str, Any]:
    r = isvc.spec.roles[role]
    _, mounts = _volumes(isvc, r)
    # RDMA registers (pins) KV memory: the container needs IPC_LOCK to lock it.
    caps = ("IPC_LOCK",) if _uses_rdma(isvc, role) else ()
    container = {
        "name": "engine", "image": isvc.spec.image, "imagePullPolicy": isvc.spec.image_pull_policy,
        "command": ["baton", "serve"], "args": engine_args(isvc, role),
        "ports": _ports(isvc, role), "env": _env(isvc, r),
        "resources": resources(r.resources, _extended_resources(isvc, r, role)),
        "startupProbe": tcp_probe("http", STARTUP_PERIOD, STARTUP_SECONDS // STARTUP_PERIOD),
        "readinessProbe": http_probe("http", "/health", 5, 3),
        "livenessProbe": tcp_probe("http", 10, 6),
        "securityContext": container_security_context(caps),
    }
    prestop = min(PRESTOP_SECONDS, r.termination_grace_seconds // 4)  # counts against the grace period
    if prestop > 0:
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(prestop)]}}}
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _pod_annotations(isvc: InferenceService, role: Role) -> dict[str, str]:
    ann = {"prometheus.io/scrape": "true", "prometheus.io/port": str(naming.ENGINE_PORT),
           "prometheus.io/path": "/metrics"}
    if role is Role.PREFILL:
        ann[naming.BOOTSTRAP_PORT_ANNOTATION] = str(isvc.spec.kv_transfer.bootstrap_port)
    return ann


def _strategy(r: RoleSpec) -> dict[str, Any]:
    # Default: a new pod is Ready before an old one goes (maxSurge 1, maxUnavailable 0), so a rollout never
    # leaves a role without a serving pod; a surge pod needs a spare GPU (or host port): spec.<role>.rollingUpdate.
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": r.rollout_max_surge,
                                                       "maxUnavailable": r.rollout_max_unavailable}}


def _spread(isvc: InferenceService, r: RoleSpec, role: Role) -> list[dict[str, Any]]:
    return spread_over_nodes(isvc, role) if r.placement.topology_spread is None else r.placement.topology_spread


def engine_pod_spec(isvc: InferenceService, role: Role) -> dict[str, Any]:
    spec, r = isvc.spec, isvc.spec.roles[role]
    volumes, _ = _volumes(isvc, r)
    pod: dict[str, Any] = {
        "containers": [engine_container(isvc, role)],
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "terminationGracePeriodSeconds": r.termination_grace_seconds,
        "securityContext": pod_security_context(spec.pod_security),
        **placement_fields(r.placement.node_selector, r.placement.tolerations, r.placement.affinity,
                           _spread(isvc, r, role)),
    }
    if volumes:
        pod["volumes"] = volumes
    if spec.model.fetched:
        fetch = fetch_container(isvc, r)
        pod["initContainers"] = [in_place_fetch(isvc, fetch) if spec.model.in_place else fetch]
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    if role is not Role.COLOCATED and spec.kv_transfer.host_network:
        pod.update(hostNetwork=True, dnsPolicy="ClusterFirstWithHostNet")
    return pod


def engine_deployment(isvc: InferenceService, role: Role) -> dict[str, Any]:
    assert role in isvc.spec.roles, f"{role} is not an engine role of mode {isvc.spec.mode}"
    r = isvc.spec.roles[role]
    name = naming.child_name(isvc.name, role)
    # external autoscaling or the planner: replicas is the count it is created with; apply() keeps the live
    # one after
    owner = isvc.spec.replicas_owner(role)
    annotations = {naming.REPLICAS_ANNOTATION: owner} if owner else None
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(isvc, name, role, annotations),
        "spec": {
            "replicas": isvc.spec.initial_replicas(role),
            "selector": {"matchLabels": naming.selector_labels(isvc.name, role)},
            "strategy": _strategy(r),
            "progressDeadlineSeconds": STARTUP_SECONDS,
            "revisionHistoryLimit": 5,
            "template": {
                "metadata": {"labels": naming.common_labels(isvc.name, role),
                             "annotations": _pod_annotations(isvc, role)},
                "spec": engine_pod_spec(isvc, role),
            },
        },
    }


def engine_service(isvc: InferenceService, role: Role) -> dict[str, Any]:
    """Headless Service: stable DNS for the role's pods and a target for ServiceMonitors."""
    ports = [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"], "protocol": "TCP"}
             for p in _ports(isvc, role)]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": metadata(isvc, naming.child_name(isvc.name, role), role),
        "spec": {"clusterIP": "None", "selector": naming.selector_labels(isvc.name, role),
                 "ports": ports, "publishNotReadyAddresses": False},
    }
