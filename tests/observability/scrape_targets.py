"""Prometheus scrape configs that give local processes the labels a cluster gives pods.

In a cluster the Prometheus Operator turns the operator's PodMonitor into a scrape job: pods come from
Kubernetes service discovery with `__meta_kubernetes_*` labels, and relabeling keeps the selected pods
and the named port, then writes `namespace`, `pod`, `container`, `endpoint`, `job` and finally the
PodMonitor's own `relabelings`. Here the same meta labels are set on static targets (taken from the
Deployments the operator builds) and the same relabeling runs in Prometheus, so the test sees the
labels a cluster would.
"""
from __future__ import annotations

import re
from typing import Any

_SANITIZE = re.compile(r"[^a-zA-Z0-9_]")


def meta_label(pod_label: str) -> str:
    return "__meta_kubernetes_pod_label_" + _SANITIZE.sub("_", pod_label)


def pod_target(address: str, namespace: str, deployment: dict[str, Any]) -> dict[str, Any]:
    """A static target standing for one pod of `deployment` (its template's labels and container)."""
    template = deployment["spec"]["template"]
    container = template["spec"]["containers"][0]
    labels = {meta_label(k): v for k, v in template["metadata"]["labels"].items()}
    labels.update({"__meta_kubernetes_namespace": namespace,
                   "__meta_kubernetes_pod_name": f"{deployment['metadata']['name']}-5d9c7b8f6d-x2x7q",
                   "__meta_kubernetes_pod_container_name": container["name"],
                   "__meta_kubernetes_pod_container_port_name": "http"})
    return {"targets": [address], "labels": labels}


def _operator_relabeling(rule: dict[str, Any]) -> dict[str, Any]:
    """A monitoring.coreos.com RelabelConfig (camelCase) as a Prometheus relabel_config."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
            "regex": "regex", "replacement": "replacement", "action": "action", "modulus": "modulus"}
    unknown = set(rule) - set(keys)
    assert not unknown, f"relabeling fields this emulation does not know: {unknown}"
    out = {keys[k]: v for k, v in rule.items()}
    if "action" in out:
        out["action"] = out["action"].lower()
    return out


def pod_monitor_job(pod_monitor: dict[str, Any], targets: list[dict[str, Any]], interval: str) -> dict[str, Any]:
    """The scrape job the Prometheus Operator generates for `pod_monitor`, over static `targets`."""
    meta, spec = pod_monitor["metadata"], pod_monitor["spec"]
    [endpoint] = spec["podMetricsEndpoints"]
    selector = spec["selector"]["matchLabels"]
    relabel = [{"source_labels": [meta_label(k)], "regex": re.escape(v), "action": "keep"} for k, v in selector.items()]
    relabel += [
        {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": endpoint["port"], "action": "keep"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": endpoint["port"]},
    ]
    relabel += [_operator_relabeling(r) for r in endpoint.get("relabelings", [])]
    return {"job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/0", "scrape_interval": interval,
            "metrics_path": endpoint["path"], "static_configs": targets, "relabel_configs": relabel}


def static_job(name: str, address: str, labels: dict[str, str], interval: str) -> dict[str, Any]:
    return {"job_name": name, "scrape_interval": interval, "static_configs": [{"targets": [address], "labels": labels}]}
