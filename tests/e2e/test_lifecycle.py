"""Changes to a running InferenceService on the real control plane: a spec change rolls only the
Deployment it concerns (a new ReplicaSet there, nothing new elsewhere); scaling changes only replicas."""
from __future__ import annotations

import json
from typing import Any

import pytest
from e2e_support import (children, conditions, create_namespace, get_json, get_or_none, isvc_condition,
                         pod_ready, printer_row, sample, wait_for)

from baton_testing.kube.controlplane import ControlPlane

NS = "e2e-lifecycle"
NAME = "smollm2"
ROLES = ("prefill", "decode", "router")


def snapshot(cp: ControlPlane) -> dict[str, dict[str, Any]]:
    """Per role: Deployment generation and template, its ReplicaSets and its ready pods."""
    objs = children(cp, NS, NAME)
    out: dict[str, dict[str, Any]] = {}
    for role in ROLES:
        def mine(kind: str, role: str = role) -> list[dict[str, Any]]:
            return [o for o in objs if o["kind"] == kind and o["metadata"]["labels"].get("baton.dev/role") == role]
        [dep] = [d for d in mine("Deployment")]
        out[role] = {
            "generation": dep["metadata"]["generation"], "replicas": dep["spec"]["replicas"],
            "template": dep["spec"]["template"],
            "replicasets": {rs["metadata"]["name"]: rs["spec"]["replicas"] for rs in mine("ReplicaSet")},
            "pods": {p["metadata"]["uid"] for p in mine("Pod") if pod_ready(p)},
            "settled": (dep["status"].get("observedGeneration") == dep["metadata"]["generation"]
                        and dep["status"].get("updatedReplicas") == dep["spec"]["replicas"]
                        and dep["status"].get("readyReplicas") == dep["spec"]["replicas"]
                        and dep["status"].get("replicas") == dep["spec"]["replicas"]),
        }
    return out


def settled(cp: ControlPlane, **replicas: int) -> dict[str, dict[str, Any]]:
    """Wait until every Deployment has rolled out, with `replicas` where given, and the status says so."""
    def probe() -> dict[str, dict[str, Any]] | None:
        snap = snapshot(cp)
        ok = all(s["settled"] for s in snap.values()) and all(
            snap[r]["replicas"] == n and len(snap[r]["pods"]) == n for r, n in replicas.items())
        return snap if ok else None
    snap = wait_for(probe, f"rollout settled ({replicas})")
    isvc_condition(cp, NS, NAME, "Progressing", "False")
    return snap


def patch(cp: ControlPlane, spec: dict[str, Any]) -> None:
    cp.kubectl("patch", "inferenceservice", NAME, "-n", NS, "--type", "merge", "-p", json.dumps({"spec": spec}))


@pytest.fixture(scope="module")
def running(control_plane: ControlPlane, operator) -> dict[str, dict[str, Any]]:
    create_namespace(control_plane, NS)
    control_plane.apply([sample("cpu-smollm2.yaml", NS)])
    isvc_condition(control_plane, NS, NAME, "Ready", "True", timeout=120)
    return settled(control_plane, prefill=1, decode=1, router=1)


def test_spec_change_rolls_only_the_affected_deployment(control_plane: ControlPlane, running):
    before = running
    patch(control_plane, {"decode": {"extraArgs": ["--max-running-requests", "8"]}})
    wait_for(lambda: snapshot(control_plane)["decode"]["generation"] > before["decode"]["generation"],
             "decode Deployment patched")
    after = settled(control_plane, decode=1)
    args = after["decode"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["--max-running-requests", "8"]
    # decode: a new ReplicaSet with the one pod, the old one scaled to zero, a new pod
    new = set(after["decode"]["replicasets"]) - set(before["decode"]["replicasets"])
    assert len(new) == 1 and after["decode"]["replicasets"][new.pop()] == 1
    assert all(after["decode"]["replicasets"][rs] == 0 for rs in before["decode"]["replicasets"])
    assert not after["decode"]["pods"] & before["decode"]["pods"]
    for role in ("prefill", "router"):  # untouched: same generation, ReplicaSets and pods
        for key in ("generation", "replicasets", "pods", "template"):
            assert after[role][key] == before[role][key], (role, key)


def test_scaling_changes_only_replicas(control_plane: ControlPlane, running):
    before = settled(control_plane)
    patch(control_plane, {"prefill": {"replicas": 2}})
    after = settled(control_plane, prefill=2)
    assert after["prefill"]["template"] == before["prefill"]["template"]  # no rollout, no new ReplicaSet
    assert set(after["prefill"]["replicasets"]) == set(before["prefill"]["replicasets"])
    assert max(after["prefill"]["replicasets"].values()) == 2
    assert before["prefill"]["pods"] < after["prefill"]["pods"]  # the running pod stays, one joins
    for role in ("decode", "router"):
        for key in ("generation", "replicasets", "pods", "template"):
            assert after[role][key] == before[role][key], (role, key)
    isvc = isvc_condition(control_plane, NS, NAME, "Ready", "True")
    assert isvc["status"]["prefill"] == {"desiredReplicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                         "availableReplicas": 2, "summary": "2/2"}
    wait_for(lambda: printer_row(control_plane, NS, NAME)["PREFILL"] == "2/2", "printer column PREFILL 2/2")
    dep = get_json(control_plane, "deployment", f"{NAME}-prefill", "-n", NS)
    assert dep["spec"]["replicas"] == 2


def test_pods_the_scheduler_cannot_place_are_said_in_the_status(control_plane: ControlPlane, operator):
    """The CPU node has no GPUs and the spec does not tolerate the GPU node's taint: the real scheduler's
    verdict reaches the conditions within a resync."""
    ns = create_namespace(control_plane, "e2e-unschedulable")
    control_plane.apply([sample("cpu-smollm2.yaml", ns, decode={"gpus": 8, "dp": 8})])
    decode = wait_for(lambda: (c := conditions(get_or_none(control_plane, "inferenceservice", NAME, "-n", ns))
                               .get("DecodeReady")) and c["reason"] == "Unschedulable" and c,
                      "DecodeReady=False, reason Unschedulable", timeout=60)
    assert "Insufficient nvidia.com/gpu" in decode["message"] and "spec.decode" in decode["message"]
    ready = conditions(get_or_none(control_plane, "inferenceservice", NAME, "-n", ns))["Ready"]
    assert ready["reason"] == "Unschedulable" and "Insufficient nvidia.com/gpu" in ready["message"]
    control_plane.kubectl("delete", "inferenceservice", NAME, "-n", ns, "--wait=false")


def test_each_role_has_a_disruption_budget_the_cluster_counts(control_plane: ControlPlane, running):
    for role in ROLES:
        pdb = wait_for(lambda role=role: (p := get_or_none(control_plane, "poddisruptionbudget", f"{NAME}-{role}",
                                                           "-n", NS)) and (p.get("status") or {}).get(
                           "disruptionsAllowed") == 1 and p, f"PodDisruptionBudget {NAME}-{role} allows 1")
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == {"baton.dev/inference-service": NAME, "baton.dev/role": role}
