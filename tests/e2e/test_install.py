"""`kubectl apply -f manifests/` on a real API server, and the operator's identity and permissions."""
from __future__ import annotations

import importlib
import json

import pytest
from e2e_support import can_i, get_json
from kubernetes.config import kube_config

from baton.operator.kube import KubeClient, login
from baton_testing.kube.controlplane import ControlPlane

OPERATOR_SA = "system:serviceaccount:baton-system:baton-operator"


def test_manifests_install_the_crd_rbac_and_operator(control_plane: ControlPlane, installed: str):
    for line in ("namespace/baton-system", "customresourcedefinition.apiextensions.k8s.io/inferenceservices.baton.dev",
                 "serviceaccount/baton-operator", "clusterrole.rbac.authorization.k8s.io/baton-operator",
                 "clusterrolebinding.rbac.authorization.k8s.io/baton-operator", "deployment.apps/baton-operator",
                 "service/baton-operator"):
        assert line in installed, installed
    crd = get_json(control_plane, "crd", "inferenceservices.baton.dev")
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established["Established"] == "True" and established["NamesAccepted"] == "True"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["bisvc"]
    # the API server serves it under its names
    out = control_plane.kubectl("api-resources", "--api-group=baton.dev", "-o", "name").stdout.split()
    assert out == ["inferenceservices.baton.dev"]


@pytest.mark.parametrize(("verb", "resource", "namespace", "allowed"), [
    ("patch", "inferenceservices.baton.dev/status", "team-a", True),
    ("watch", "inferenceservices.baton.dev", None, True),
    ("create", "deployments.apps", "team-a", True),
    ("create", "roles.rbac.authorization.k8s.io", "team-a", True),
    ("patch", "networkpolicies.networking.k8s.io", "team-a", True),
    ("list", "networkpolicies.networking.k8s.io", "team-a", False),
    ("list", "pods", None, True),  # granted on so the operator may grant it to each router
    ("create", "inferenceservices.baton.dev", "team-a", False),
    ("delete", "inferenceservices.baton.dev", "team-a", False),
    ("create", "secrets", "team-a", True),  # each service's internal key, which it never reads back
    ("get", "secrets", "team-a", False),
    ("list", "secrets", "team-a", False),
    ("patch", "secrets", "team-a", False),
    ("create", "pods", "team-a", False),
    ("list", "services", "team-a", False),  # children are read by name only
    ("create", "clusterroles.rbac.authorization.k8s.io", None, False),
])
def test_operator_rbac_is_least_privilege(control_plane: ControlPlane, installed: str, verb: str,
                                          resource: str, namespace: str | None, allowed: bool):
    result = can_i(control_plane, verb, resource, namespace, OPERATOR_SA)
    assert result.stdout.strip() == ("yes" if allowed else "no"), (verb, resource, result.stdout, result.stderr)


def test_operator_runs_as_its_service_account(control_plane: ControlPlane, operator):
    whoami = json.loads(control_plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=operator.kubeconfig).stdout)
    assert whoami["status"]["userInfo"]["username"] == OPERATOR_SA
    # with that token, what the ClusterRole does not grant is refused by the API server itself
    denied = control_plane.kubectl("get", "secrets", "-n", "default", kubeconfig=operator.kubeconfig, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr
    operator.assert_alive()


async def test_operator_login_uses_the_kubeconfig_it_is_given(control_plane: ControlPlane, operator, monkeypatch):
    """The kubernetes client reads $KUBECONFIG once, at import; the operator's login must not log in with
    whatever file was current then (here: the admin's) when it is started with another."""
    monkeypatch.setenv("KUBECONFIG", control_plane.kubeconfig)
    importlib.reload(kube_config)  # as if imported now, with the admin's kubeconfig current
    monkeypatch.setenv("KUBECONFIG", operator.kubeconfig)
    client = KubeClient(login)
    try:
        review = await client.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                      {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    finally:
        await client.close()
    assert review["status"]["userInfo"]["username"] == OPERATOR_SA
