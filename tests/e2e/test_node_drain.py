"""`kubectl drain` of a node that runs an InferenceService, on the real control plane.

kwok pods run no process, so this shows the Kubernetes half: the eviction API honours each role's
PodDisruptionBudget, so a drain never takes more than one pod of a role at once and moves the pods to
another node as their replacements become Ready. What an evicted engine does with its requests (SIGTERM: leave the
Service, finish what it runs, a prefill keeps serving its transfers) is shown with real processes in
tests/integration/test_drain.py.
"""
from __future__ import annotations

import re

from e2e_support import children, create_namespace, isvc_condition, pod_ready, sample, wait_for

from baton_testing.kube.controlplane import ControlPlane
from baton_testing.kube.fake_nodes import fake_node

NS = "e2e-drain"
NAME = "drained"  # `kubectl drain --pod-selector` picks pods in every namespace: a name no other test uses
SPARE = "kwok-cpu-1"


def _pods(cp: ControlPlane) -> list[dict]:
    return [o for o in children(cp, NS, NAME) if o["kind"] == "Pod" and not o["metadata"].get("deletionTimestamp")]


def _ready_by_role(cp: ControlPlane) -> dict[str, int]:
    out = {"prefill": 0, "decode": 0}
    for p in _pods(cp):
        role = p["metadata"]["labels"].get("baton.dev/role")
        if role in out and pod_ready(p):
            out[role] += 1
    return out


def _engine_pods_on(cp: ControlPlane, node: str) -> dict[str, int]:
    out = {"prefill": 0, "decode": 0}
    for p in _pods(cp):
        role = p["metadata"]["labels"].get("baton.dev/role")
        if role in out and p["spec"].get("nodeName") == node:
            out[role] += 1
    return out


def _drain(cp: ControlPlane, timeout_s: int):
    """Drain kwok-cpu-0 of this test's pods; other tests' pods (other namespaces) stay where they are."""
    result = cp.kubectl("drain", "kwok-cpu-0", "--pod-selector", f"baton.dev/inference-service={NAME}",
                        "--ignore-daemonsets", "--delete-emptydir-data", f"--timeout={timeout_s}s", check=False)
    evicted = set(re.findall(r"evicting pod (\S+)/\S+", result.stdout + result.stderr))
    assert evicted and evicted <= {NS}, f"the drain evicted pods of {evicted}:\n{result.stdout}{result.stderr}"
    return result


def test_a_node_drain_takes_one_pod_of_a_role_at_a_time(control_plane: ControlPlane, operator):
    """Two pods per engine role on the only CPU node. Drained with nowhere for replacements to go, the
    eviction API lets one pod of each role go and refuses the second (its budget allows one
    unavailable), so the drain times out with every role still serving; once a second node is there
    the replacements become Ready there and the drain completes, every pod moved."""
    cp = control_plane
    create_namespace(cp, NS)
    body = sample("cpu-smollm2.yaml", NS)
    body["metadata"]["name"] = NAME
    for role in ("prefill", "decode"):
        body["spec"].setdefault(role, {})["replicas"] = 2
    cp.apply([body])
    isvc_condition(cp, NS, NAME, "Ready", "True", timeout=120)
    wait_for(lambda: _ready_by_role(cp) == {"prefill": 2, "decode": 2}, "two ready pods per engine role")
    assert {p["spec"].get("nodeName") for p in _pods(cp)} == {"kwok-cpu-0"}  # the only CPU node
    try:
        stuck = _drain(cp, 12)
        assert stuck.returncode != 0, stuck.stdout
        assert "would violate the pod's disruption budget" in stuck.stdout + stuck.stderr, stuck.stdout + stuck.stderr
        assert _engine_pods_on(cp, "kwok-cpu-0") == {"prefill": 1, "decode": 1}, "one pod of each role evicted"
        assert _ready_by_role(cp) == {"prefill": 1, "decode": 1}, "the other one still serves"

        cp.apply([fake_node(SPARE, {"cpu": "64", "memory": "256Gi", "pods": "110"})])
        wait_for(lambda: _ready_by_role(cp) == {"prefill": 2, "decode": 2}, f"the replacements ready on {SPARE}")
        done = _drain(cp, 120)
        assert done.returncode == 0, done.stdout + done.stderr
        after = wait_for(lambda: (pods := _pods(cp)) and all(pod_ready(p) for p in pods)
                         and _ready_by_role(cp) == {"prefill": 2, "decode": 2} and pods, "the pods ready again")
        assert {p["spec"]["nodeName"] for p in after} == {SPARE}, "every pod moved off the drained node"
        isvc_condition(cp, NS, NAME, "Ready", "True", timeout=60)
    finally:
        cp.kubectl("uncordon", "kwok-cpu-0", check=False)
        cp.kubectl("delete", "namespace", NS, "--wait=false", check=False)
        # the pods go before their node does: kwok finishes deleting pods only on nodes it manages, and a pod
        # left bound to a deleted node stays for good (this control plane runs no pod garbage collector)
        cp.kubectl("delete", "pods", "--all", "-n", NS, "--force", "--grace-period=0", check=False)
        cp.kubectl("delete", "node", SPARE, "--wait=false", check=False)
