"""Pieces every builder uses: metadata with owner references, the spec hash, security contexts."""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from baton.operator import naming
from baton.operator.naming import Role
from baton.operator.spec import InferenceService, PodSecuritySpec


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    """Children are garbage-collected with their InferenceService (foreground deletion waits)."""
    return {"apiVersion": naming.API_VERSION, "kind": naming.KIND, "name": isvc.name,
            "uid": isvc.uid, "controller": True, "blockOwnerDeletion": True}


def metadata(isvc: InferenceService, name: str, role: Role | None = None,
             annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": isvc.namespace,
                            "labels": naming.common_labels(isvc.name, role),
                            "ownerReferences": [owner_reference(isvc)]}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def external_replicas(obj: dict[str, Any]) -> bool:
    """Not the spec's count: an HPA or KEDA (spec.autoscaling.mode external) or the planner (mode planner)
    sets this Deployment's replicas, so a reconcile never resets them."""
    annotations = obj.get("metadata", {}).get("annotations") or {}
    return annotations.get(naming.REPLICAS_ANNOTATION) in (naming.EXTERNAL_REPLICAS, naming.PLANNER_REPLICAS)


def spec_hash(obj: dict[str, Any]) -> str:
    """Hash of a desired object, without its own hash annotation. Equal hashes: nothing to patch."""
    body = copy.deepcopy(obj)
    body.get("metadata", {}).get("annotations", {}).pop(naming.SPEC_HASH_ANNOTATION, None)
    if external_replicas(body):  # a new initial count is no change to apply
        body["spec"].pop("replicas", None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def stamp(obj: dict[str, Any]) -> dict[str, Any]:
    """Return `obj` with the spec-hash annotation set (on the object, never on a pod template)."""
    obj = copy.deepcopy(obj)
    obj["metadata"].setdefault("annotations", {})[naming.SPEC_HASH_ANNOTATION] = spec_hash(obj)
    return obj


def pod_security_context(sec: PodSecuritySpec) -> dict[str, Any]:
    ctx: dict[str, Any] = {"seccompProfile": {"type": "RuntimeDefault"}}
    if sec.run_as_non_root:
        ctx.update(runAsNonRoot=True, runAsUser=sec.run_as_user, runAsGroup=sec.run_as_user,
                   fsGroup=sec.fs_group)
    return ctx


def container_security_context(add_capabilities: tuple[str, ...] = (),
                               read_only_root: bool = False) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if add_capabilities:
        caps["add"] = list(add_capabilities)
    return {"allowPrivilegeEscalation": False, "capabilities": caps,
            "readOnlyRootFilesystem": read_only_root}


def http_probe(port: str, path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period,
            "timeoutSeconds": 5, "failureThreshold": failures}


def tcp_probe(port: str, period: int, failures: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": port}, "periodSeconds": period, "timeoutSeconds": 5,
            "failureThreshold": failures}


def spread_over_nodes(isvc: InferenceService, role: Role) -> list[dict[str, Any]]:
    """The default topology spread: a role's pods on as many nodes as may be (a preference, never a reason
    to stay Pending), so one node's drain or loss takes few of them."""
    return [{"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
             "labelSelector": {"matchLabels": naming.selector_labels(isvc.name, role)}}]


def placement_fields(node_selector: dict[str, str], tolerations: list[dict[str, Any]],
                     affinity: dict[str, Any] | None, spread: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if spread:
        out["topologySpreadConstraints"] = copy.deepcopy(spread)
    if node_selector:
        out["nodeSelector"] = dict(node_selector)
    if tolerations:
        out["tolerations"] = copy.deepcopy(tolerations)
    if affinity:
        out["affinity"] = copy.deepcopy(affinity)
    return out


def resources(base: dict[str, Any], extra: dict[str, int]) -> dict[str, Any]:
    """User requests/limits plus extended resources (GPUs, RDMA) set as both request and limit."""
    out = {k: dict(v) for k, v in copy.deepcopy(base).items() if v}
    for name, count in extra.items():
        out.setdefault("limits", {})[name] = count
        out.setdefault("requests", {})[name] = count
    return out
