"""Each sample InferenceService on the real control plane: children with owner references, pods Running
on kwok nodes, Ready status, printer columns, and garbage collection of everything on delete."""
from __future__ import annotations

from typing import Any

import pytest
import yaml
from e2e_support import (SAMPLES, children, conditions, controller_of, get_json, isvc_condition, pod_ready,
                         printer_row, wait_for)

from baton_testing.kube.controlplane import ControlPlane
from baton_testing.kube.fake_nodes import FAKE_NODES

SAMPLE_FILES = sorted(p.name for p in SAMPLES.glob("*.yaml"))
OPERATOR_KINDS = {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Secret", "NetworkPolicy"}


def _prerequisites(cp: ControlPlane, body: dict[str, Any]) -> None:
    """What a sample's comments ask the user to create first: the API key Secret, the weights' PVC."""
    spec, ns = body["spec"], body["metadata"]["namespace"]
    secret = (spec.get("router") or {}).get("apiKeySecretRef")
    if secret:
        cp.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret["name"], "namespace": ns},
                   "stringData": {secret.get("key", "api-key"): "e2e-not-a-secret"}}])
    pvc = (spec["model"].get("pvc") or {}).get("claimName")
    if pvc:  # a pre-bound pair; the persistent-volume controller binds them, the scheduler needs that
        cp.apply([
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"e2e-{ns}-{pvc}"},
             "spec": {"capacity": {"storage": "100Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                      "hostPath": {"path": "/tmp/models"},
                      "claimRef": {"namespace": ns, "name": pvc}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": pvc, "namespace": ns},
             "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"e2e-{ns}-{pvc}",
                      "resources": {"requests": {"storage": "100Gi"}}}}])
        wait_for(lambda: get_json(cp, "pvc", pvc, "-n", ns)["status"].get("phase") == "Bound", f"PVC {pvc} bound")


def _roles(body: dict[str, Any]) -> dict[str, int]:
    """Expected pods per role label."""
    spec = body["spec"]
    roles = {"colocated": "engine"} if spec.get("mode") == "colocated" else {"prefill": "prefill", "decode": "decode"}
    out = {label: (spec.get(key) or {}).get("replicas", 1) for label, key in roles.items()}
    out["router"] = (spec.get("router") or {}).get("replicas", 1)
    return out


def _check_ownership(objs: list[dict[str, Any]], isvc: dict[str, Any]) -> None:
    by_uid = {o["metadata"]["uid"]: o for o in objs}
    for obj in objs:
        ref = controller_of(obj)
        if obj["kind"] in OPERATOR_KINDS:
            assert (ref["kind"], ref["name"], ref["uid"], ref["blockOwnerDeletion"]) == \
                ("InferenceService", isvc["metadata"]["name"], isvc["metadata"]["uid"], True), obj["metadata"]
        else:  # what the controllers made: ReplicaSet -> Deployment, Pod -> ReplicaSet, up to the service
            owner = by_uid[ref["uid"]]
            assert (obj["kind"], owner["kind"]) in {("ReplicaSet", "Deployment"), ("Pod", "ReplicaSet")}


def _check_pods(objs: list[dict[str, Any]], expected: dict[str, int], gpu: bool) -> None:
    pods = [o for o in objs if o["kind"] == "Pod"]
    by_role: dict[str, int] = {}
    for pod in pods:
        assert pod_ready(pod), (pod["metadata"]["name"], pod["status"])
        assert pod["spec"]["nodeName"] in {n["metadata"]["name"] for n in FAKE_NODES}
        role = pod["metadata"]["labels"]["baton.dev/role"]
        by_role[role] = by_role.get(role, 0) + 1
        if gpu and role in ("prefill", "decode"):  # the sample's nodeSelector, tolerations, GPU requests
            assert pod["spec"]["nodeName"] == "kwok-gpu-0"
    assert by_role == expected


def _check_columns(row: dict[str, str], isvc: dict[str, Any], expected: dict[str, int]) -> None:
    st = isvc["status"]
    assert row["READY"] == "True" and row["ROUTER"] == f"{expected['router']}/{expected['router']}"
    if "colocated" in expected:
        n = expected["colocated"]
        assert (row["ENGINE"], row["PREFILL"], row["DECODE"], row["MODE"]) == (f"{n}/{n}", "", "", "colocated")
    else:
        p, d = expected["prefill"], expected["decode"]
        assert (row["PREFILL"], row["DECODE"], row["ENGINE"], row["MODE"]) == (f"{p}/{p}", f"{d}/{d}", "",
                                                                                 "disaggregated")
    assert row["ENDPOINT"] == st["endpoint"] and row["MODEL"] == isvc["spec"]["model"]["name"]


@pytest.mark.parametrize("file", SAMPLE_FILES)
def test_sample_runs_and_is_collected(control_plane: ControlPlane, operator, file: str):
    body = yaml.safe_load((SAMPLES / file).read_text())
    name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
    expected = _roles(body)
    _prerequisites(control_plane, body)
    out = control_plane.kubectl("apply", "-f", str(SAMPLES / file))
    assert f"inferenceservice.baton.dev/{name} created" in out.stdout, out.stdout
    isvc = isvc_condition(control_plane, ns, name, "Ready", "True", timeout=120)

    def settled() -> list[dict[str, Any]] | None:
        objs = children(control_plane, ns, name)
        pods = [o for o in objs if o["kind"] == "Pod"]
        return objs if len(pods) == sum(expected.values()) and all(map(pod_ready, pods)) else None
    objs = wait_for(settled, f"all pods of {name} Running and Ready")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for role in expected:
        child = f"{name}-{'engine' if role == 'colocated' else role}"
        assert {("Deployment", child), ("Service", child)} <= kinds
    assert {("ServiceAccount", f"{name}-router"), ("Role", f"{name}-router"), ("RoleBinding", f"{name}-router"),
            ("ConfigMap", f"{name}-topology"),
            ("Secret", f"{name}-internal-key-{isvc['metadata']['uid'][:8]}"),  # created with create only
            ("NetworkPolicy", f"{name}-engines")} <= kinds
    _check_ownership(objs, isvc)
    _check_pods(objs, expected, gpu="gpu" in file)

    isvc = isvc_condition(control_plane, ns, name, "Progressing", "False")  # rollout complete
    c = conditions(isvc)
    assert c["Ready"]["reason"] == "Serving" and c["Progressing"]["reason"] == "RolloutComplete"
    if body["spec"].get("monitoring"):  # no Prometheus Operator CRDs here: Degraded says what to do
        assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "MonitoringUnavailable")
    else:
        assert c["Degraded"]["status"] == "False", c["Degraded"]
    assert isvc["status"]["observedGeneration"] == isvc["metadata"]["generation"]
    _check_columns(printer_row(control_plane, ns, name), isvc, expected)

    control_plane.kubectl("delete", "-f", str(SAMPLES / file), "--wait=true", "--timeout=60s")
    wait_for(lambda: not children(control_plane, ns, name), f"garbage collection of every child of {name}")
