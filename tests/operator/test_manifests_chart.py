"""manifests/ and the Helm chart: Kubernetes' own schemas (kubernetes-validate) and real Helm
(helm-python-sdk: Helm v4's Go SDK in a bundled shared library, no helm binary, no download)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from baton.operator.builders import build_children
from baton.operator.crd import build_crd
from baton.operator.install import CLUSTER_ROLE_RULES, CLUSTER_SCOPED_RULES, NAMESPACED_RULES, operator_deployment
from baton.operator.spec import parse
from baton_testing.kube.objects import isvc_body

K8S_VERSIONS = ["1.29.0", "1.33.0"]  # oldest with CEL validation GA, and a recent one
NO_UPSTREAM_SCHEMA = {"PodMonitor", "ServiceMonitor", "InferenceService"}  # CRDs: checked elsewhere


def k8s_validate(obj: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_manifests_validate_against_kubernetes_schemas(repo: Path):
    kinds = []
    for path in sorted((repo / "manifests").glob("*.yaml")):
        for obj in load_all(path):
            k8s_validate(obj)
            kinds.append(obj["kind"])
    assert sorted(kinds) == sorted(["Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                                    "ClusterRoleBinding", "Deployment", "Service"])


@pytest.mark.parametrize("spec", [
    {}, {"mode": "colocated"}, {"mode": "colocated", "engine": {"tp": 2, "gpus": 2}},
    {"prefill": {"gpus": 2, "dp": 2, "tolerations": [{"key": "gpu", "operator": "Exists"}], "shmSize": "8Gi"},
     "kvTransfer": {"protocol": "rdma", "ibDevices": ["mlx5_0"], "rdmaResourceName": "rdma/x", "hostNetwork": True},
     "model": {"name": "m", "path": "/m", "pvc": {"claimName": "c", "subPath": "m"}}},
    {"router": {"apiKeySecretRef": {"name": "k"}, "service": {"type": "NodePort"}},
     "model": {"name": "m", "path": "/m", "hostPath": {"path": "/data/m"}}, "imagePullSecrets": ["regcred"]},
], ids=["default", "colocated", "colocated-tp2", "gpu-rdma-pvc", "apikey-hostpath"])
def test_generated_children_validate_against_kubernetes_schemas(spec):
    children = build_children(parse(isvc_body(monitoring={"podMonitor": True, "serviceMonitor": True}, **spec)))
    checked = [o for o in children if o["kind"] not in NO_UPSTREAM_SCHEMA]
    for obj in checked:
        k8s_validate(obj)
    assert {o["kind"] for o in checked} >= {"Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "ConfigMap"}


def test_samples_have_only_inference_services(samples):
    assert {s["kind"] for s in samples.values()} == {"InferenceService"}


@pytest.fixture
def chart(repo: Path) -> str:
    return str(repo / "charts" / "baton")


def test_helm_lint_has_no_errors(chart: str):
    result = helm.lint(chart)
    assert result["errors"] == [], result
    assert not [m for m in result["messages"] if m["severity"] > 1], result["messages"]


def render(chart: str, values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(chart) as c:
        c.validate_schema(values)
        rendered = c.render(values, name="baton", namespace="baton-system")
    return [d for name, text in sorted(rendered.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


def test_chart_renders_operator_objects_that_validate(chart: str):
    objs = render(chart, {})
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service",
                            "ConfigMap"])
    for obj in objs:
        k8s_validate(obj)
    [dep] = [o for o in objs if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--all-namespaces" in args and "--standalone" in args and "--prometheus-url" not in args
    # where the operator runs, for the engines' NetworkPolicies: as manifests/03-operator.yaml says it
    [manifest] = [o for o in operator_deployment() if o["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["containers"][0]["env"] == \
        manifest["spec"]["template"]["spec"]["containers"][0]["env"]
    assert dep["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "baton-operator"
    [role] = [o for o in objs if o["kind"] == "ClusterRole"]
    assert role["rules"] == CLUSTER_ROLE_RULES  # same least privilege as manifests/02-rbac.yaml


def test_chart_options_monitoring_namespaces_dashboards(chart: str):
    objs = render(chart, {"operator": {"watchNamespaces": ["team-a", "team-b"]},
                          "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                                      "podMonitor": {"enabled": True}},
                          "dashboards": {"namespace": "monitoring"}})
    kinds = {o["kind"] for o in objs}
    assert {"ServiceMonitor", "PodMonitor"} <= kinds
    [dep] = [o for o in objs if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["--namespace", "team-a", "--namespace", "team-b"] and "--all-namespaces" not in args
    [dash] = [o for o in objs if o["kind"] == "ConfigMap"]
    assert dash["metadata"]["namespace"] == "monitoring" and dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(dash["data"]["baton-operator.json"])
    assert board["title"] and board["panels"]
    objs = render(chart, {"dashboards": {"enabled": False}})
    assert "ConfigMap" not in {o["kind"] for o in objs}


def test_chart_with_watch_namespaces_grants_namespaced_rules_only_there(chart: str):
    objs = render(chart, {"operator": {"watchNamespaces": ["team-a", "team-b"]}})
    for obj in objs:
        k8s_validate(obj)
    [cluster_role] = [o for o in objs if o["kind"] == "ClusterRole"]
    assert cluster_role["rules"] == CLUSTER_SCOPED_RULES  # only what kopf reads cluster-wide
    [binding] = [o for o in objs if o["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == cluster_role["metadata"]["name"]
    roles = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "Role"}
    bindings = {o["metadata"]["namespace"]: o for o in objs if o["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    [sa] = [o for o in objs if o["kind"] == "ServiceAccount"]
    for ns, role in roles.items():
        assert role["rules"] == NAMESPACED_RULES, ns
        assert bindings[ns]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                           "name": role["metadata"]["name"]}
        assert bindings[ns]["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                             "namespace": "baton-system"}]
    assert not [o for o in render(chart, {"operator": {"watchNamespaces": ["team-a"]}, "rbac": {"create": False}})
                if o["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")]


def test_chart_values_schema_refuses_wrong_values(chart: str):
    with helm.Chart.load(chart) as c:
        with pytest.raises(helm.HelmError) as info:
            c.validate_schema({"metrics": {"port": "nine"}})
    assert "port" in str(info.value)


def test_chart_crd_is_the_generated_one(repo: Path):
    [crd] = load_all(repo / "charts" / "baton" / "crds" / "inferenceservices.baton.dev.yaml")
    assert crd == build_crd()


def test_every_dashboard_is_valid_json(repo: Path):
    boards = sorted((repo / "charts" / "baton" / "dashboards").glob("*.json"))
    assert boards
    for path in boards:
        board = json.loads(path.read_text())
        assert {"title", "uid", "panels"} <= set(board), path


def test_sample_comments_say_what_their_spec_does(repo: Path, samples):
    import re

    for name, body in samples.items():
        text = (repo / "manifests" / "samples" / name).read_text()
        comments = " ".join(line.lstrip("# ") for line in text.splitlines() if line.lstrip().startswith("#"))
        assert "does not implement tensor" not in comments, name  # it does: docs/operator.md
        for count, role, tp in re.findall(r"(\d+) (prefill|decode) pods \(TP (\d+)\)", comments):
            spec = body["spec"][role]
            assert (int(count), int(tp)) == (spec.get("replicas", 1), spec.get("tp", 1)), (name, role)


def test_chart_points_the_planner_at_prometheus(chart: str):
    url = "http://prometheus-operated.monitoring:9090"
    [dep] = [o for o in render(chart, {"operator": {"prometheusUrl": url}}) if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--prometheus-url") + 1] == url
    with pytest.raises(Exception, match="prometheusUrl"):
        render(chart, {"operator": {"prometheusUrl": "prometheus:9090"}})  # no scheme
