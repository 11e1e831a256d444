"""The Helm chart, rendered by real Helm (helm-python-sdk), applied to the real control plane: what
`helm install` would send (CRDs from crds/ first, then the templates) is accepted as it is."""
from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest
import yaml
from e2e_support import REPO, can_i, create_namespace, get_json, pod_ready, wait_for

from baton_testing.kube.controlplane import ControlPlane

CHART = REPO / "charts" / "baton"
RELEASE, NS = "e2e", "e2e-helm"


def render(values: dict[str, Any], release: str = RELEASE) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        chart.validate_schema(values)
        rendered = chart.render(values, name=release, namespace=NS)
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane) -> str:
    return create_namespace(control_plane, NS)


def test_rendered_chart_applies_cleanly(control_plane: ControlPlane, namespace: str):
    crds = sorted((CHART / "crds").glob("*.yaml"))
    assert crds
    for path in crds:
        result = control_plane.kubectl("apply", "-f", str(path))
        assert "Warning" not in result.stderr, result.stderr
    objs = render({})
    text = yaml.safe_dump_all(objs)
    dry = control_plane.kubectl("apply", "--dry-run=server", "-n", NS, "-f", "-", input=text)
    assert "Warning" not in dry.stderr, dry.stderr
    result = control_plane.kubectl("apply", "-n", NS, "-f", "-", input=text)
    assert "Warning" not in result.stderr, result.stderr
    applied = result.stdout.splitlines()
    assert len(applied) == len(objs), applied
    for obj in objs:  # each object exists as rendered
        ns = ["-n", obj["metadata"].get("namespace", NS)] if obj["kind"] not in ("ClusterRole", "ClusterRoleBinding") else []
        live = get_json(control_plane, _resource(obj), obj["metadata"]["name"], *ns)
        assert live["metadata"]["labels"].get("helm.sh/chart", "").startswith("baton-"), live["metadata"]

    # the chart's operator Deployment rolls out (kwok runs its pod) under its own ServiceAccount
    [dep] = [o for o in objs if o["kind"] == "Deployment"]
    name = dep["metadata"]["name"]
    pods = wait_for(lambda: [p for p in get_json(control_plane, "pods", "-n", NS, "-l",
                                                 f"app.kubernetes.io/instance={RELEASE}")["items"] if pod_ready(p)],
                    f"the pod of Deployment {name} Ready")
    assert pods[0]["spec"]["serviceAccountName"] == dep["spec"]["template"]["spec"]["serviceAccountName"]
    sa = f"system:serviceaccount:{NS}:{pods[0]['spec']['serviceAccountName']}"
    for verb, resource, allowed in (("patch", "inferenceservices.baton.dev/status", "yes"),
                                    ("create", "deployments.apps", "yes"), ("get", "secrets", "no")):
        got = can_i(control_plane, verb, resource, "default", sa)
        assert got.stdout.strip() == allowed, (verb, resource, got.stdout)


def test_chart_with_watch_namespaces_grants_only_those(control_plane: ControlPlane, namespace: str):
    """operator.watchNamespaces: Deployments, pods and RBAC in the watched namespace only; cluster-wide
    nothing but what kopf reads there (namespaces, CRDs)."""
    watched = create_namespace(control_plane, "e2e-helm-watched")
    for path in sorted((CHART / "crds").glob("*.yaml")):  # can-i resolves baton.dev's resources
        control_plane.kubectl("apply", "-f", str(path))
    objs = [o for o in render({"operator": {"watchNamespaces": [watched]}}, release="e2e-scoped")
            if o["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    assert {o["kind"] for o in objs} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}
    for obj in objs:  # as `helm install -n NS` does: the Roles name their own namespaces
        if not obj["kind"].startswith("Cluster"):
            obj["metadata"].setdefault("namespace", NS)
    result = control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))
    assert "Warning" not in result.stderr, result.stderr
    [sa] = [o["metadata"]["name"] for o in objs if o["kind"] == "ServiceAccount"]
    user = f"system:serviceaccount:{NS}:{sa}"
    for verb, resource, ns, allowed in (
            ("create", "deployments.apps", watched, "yes"),
            ("create", "roles.rbac.authorization.k8s.io", watched, "yes"),
            ("watch", "pods", watched, "yes"), ("patch", "inferenceservices.baton.dev/status", watched, "yes"),
            ("create", "deployments.apps", "default", "no"), ("watch", "pods", "default", "no"),
            ("list", "inferenceservices.baton.dev", None, "no"),
            ("watch", "namespaces", None, "yes"),
            ("watch", "customresourcedefinitions.apiextensions.k8s.io", None, "yes")):
        got = can_i(control_plane, verb, resource, ns, user)
        assert got.stdout.strip() == allowed, (verb, resource, ns, got.stdout)


def _resource(obj: dict[str, Any]) -> str:
    """kind.group, e.g. deployment.apps; core kinds have no group."""
    version = obj["apiVersion"]
    return obj["kind"].lower() + (f".{version.split('/')[0]}" if "/" in version else "")
