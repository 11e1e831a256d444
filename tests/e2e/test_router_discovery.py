"""The router's Kubernetes discovery on the real control plane, as the operator deploys it: `baton router`
with the args of the router Deployment, logged in with a token of the router's own ServiceAccount. It sees
exactly the Ready pods of its roles (with the bootstrap port of the annotation) and follows them."""
from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from e2e_support import (background, baton_command, can_i, create_namespace, get_json, isvc_condition, ready_pods,
                         sample, tail, wait_for)
from prometheus_client.parser import text_string_to_metric_families

from baton_testing.kube.controlplane import ControlPlane, free_port

NS = "e2e-discovery"
OTHER_NS = "e2e-discovery-other"
NAME = "smollm2"
BOOTSTRAP_PORT = 9123  # not the default 8998: it must come from the annotation
SELECTOR = {"prefill": f"baton.dev/inference-service={NAME},baton.dev/role=prefill",
            "decode": f"baton.dev/inference-service={NAME},baton.dev/role=decode"}


def router_args(cp: ControlPlane, port: int) -> list[str]:
    """The router container's args from the live Deployment, listening on loopback instead."""
    dep = get_json(cp, "deployment", f"{NAME}-router", "-n", NS)
    [container] = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["baton", "router"]
    args = list(container["args"])
    args[args.index("--host") + 1] = "127.0.0.1"
    args[args.index("--port") + 1] = str(port)
    return args


def expected_workers(cp: ControlPlane) -> set[tuple[str, str, int | None]]:
    out = set()
    for role, selector in SELECTOR.items():
        for pod in ready_pods(cp, NS, selector):
            port = int(pod["metadata"]["annotations"]["sglang.ai/bootstrap-port"]) if role == "prefill" else None
            out.add((role, f"http://{pod['status']['podIP']}:30000", port))
    return out


class RouterProcess:
    def __init__(self, port: int, log: str) -> None:
        self.port, self.log = port, log

    def workers(self) -> set[tuple[str, str, int | None]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/workers", timeout=5) as resp:
            data = json.load(resp)
        return {(w["role"], w["url"], w["bootstrap_port"]) for w in data["workers"]}

    def discovery_events(self, side: str, event: str) -> float:
        """baton_router_discovery_events_total{side, event} from the router's /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "baton_router_discovery_events_total" and s.labels == {"side": side, "event": event}:
                    return s.value
        return 0.0

    def sees(self, want: set[tuple[str, str, int | None]]) -> bool:
        try:
            return self.workers() == want
        except OSError:
            return False


@pytest.fixture(scope="module")
def router(control_plane: ControlPlane, operator) -> Iterator[RouterProcess]:
    create_namespace(control_plane, NS)
    control_plane.apply([sample("cpu-smollm2.yaml", NS, kvTransfer={"bootstrapPort": BOOTSTRAP_PORT})])
    isvc_condition(control_plane, NS, NAME, "Ready", "True", timeout=120)
    kubeconfig = control_plane.service_account_kubeconfig(NS, f"{NAME}-router")
    port = free_port()
    log = os.path.join(control_plane.workdir, "logs", "router.log")
    with background(baton_command("router", *router_args(control_plane, port)), log,
                    env={"KUBECONFIG": kubeconfig}) as proc:
        r = RouterProcess(port, log)
        yield r
        assert proc.poll() is None, f"the router exited:\n{tail(log)}"


def test_the_router_service_account_may_only_read_pods_of_its_namespace(control_plane: ControlPlane, router):
    sa = f"system:serviceaccount:{NS}:{NAME}-router"
    can = lambda verb, res, ns: can_i(control_plane, verb, res, ns, sa).stdout.strip()  # noqa: E731
    assert [can("list", "pods", NS), can("watch", "pods", NS)] == ["yes", "yes"]
    assert [can("list", "pods", OTHER_NS), can("get", "secrets", NS), can("delete", "pods", NS),
            can("list", "services", NS)] == ["no"] * 4


def test_discovery_sees_exactly_the_ready_pods_of_its_roles(control_plane: ControlPlane, router):
    want = expected_workers(control_plane)
    assert {(r, p) for r, _, p in want} == {("prefill", BOOTSTRAP_PORT), ("decode", None)}
    wait_for(lambda: router.sees(want), f"the router to list {want}", timeout=60)
    # a pod with the prefill labels that is not Ready (no node fits it), and a Ready one elsewhere
    added = router.discovery_events("prefill", "added")
    create_namespace(control_plane, OTHER_NS)
    labels = {"baton.dev/inference-service": NAME, "baton.dev/role": "prefill"}
    control_plane.apply([_pod("pending", NS, labels, {"kubernetes.io/hostname": "no-such-node"}),
                         _pod("elsewhere", OTHER_NS, labels)])
    wait_for(lambda: ready_pods(control_plane, OTHER_NS, SELECTOR["prefill"]), "the foreign pod Ready")
    pending = get_json(control_plane, "pod", "pending", "-n", NS)
    assert pending["status"]["phase"] == "Pending"
    assert router.workers() == want == expected_workers(control_plane)
    assert router.discovery_events("prefill", "added") == added


def test_discovery_follows_pods_that_come_and_go(control_plane: ControlPlane, router):
    def scale_decode(n: int) -> None:
        control_plane.kubectl("patch", "inferenceservice", NAME, "-n", NS, "--type", "merge",
                              "-p", json.dumps({"spec": {"decode": {"replicas": n}}}))
        want = wait_for(lambda: (w := expected_workers(control_plane)) and
                        sum(r == "decode" for r, _, _ in w) == n and w, f"{n} Ready decode pods")
        wait_for(lambda: router.sees(want), f"the router to list {n} decode pods", timeout=60)
    scale_decode(2)  # a pod comes
    scale_decode(1)  # a pod goes

    # a pod replaced by its ReplicaSet (kwok may give the new one the same IP): the router drops it, adds the new
    [old] = ready_pods(control_plane, NS, SELECTOR["prefill"])
    removed, added = router.discovery_events("prefill", "removed"), router.discovery_events("prefill", "added")
    control_plane.kubectl("delete", "pod", old["metadata"]["name"], "-n", NS, "--wait=false")

    def replaced() -> set[tuple[str, str, int | None]] | None:
        uids = {pod["metadata"]["uid"] for pod in ready_pods(control_plane, NS, SELECTOR["prefill"])}
        return expected_workers(control_plane) if uids and old["metadata"]["uid"] not in uids else None
    want = wait_for(replaced, "the ReplicaSet to replace the deleted prefill pod")
    wait_for(lambda: router.discovery_events("prefill", "removed") > removed
             and router.discovery_events("prefill", "added") > added and router.sees(want),
             "the router to follow the replaced prefill pod", timeout=60)


def _pod(name: str, namespace: str, labels: dict[str, str], node_selector: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": {**labels, "e2e": "stray"},
                         "annotations": {"sglang.ai/bootstrap-port": "1"}},
            "spec": {"containers": [{"name": "c", "image": "example.invalid/none"}],
                     "nodeSelector": node_selector or {}, "automountServiceAccountToken": False}}
