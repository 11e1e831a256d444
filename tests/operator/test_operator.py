"""The running operator (kopf + Baton's handlers) against an API server: emulated by default, a real
control plane with BATON_TEST_KUBECONFIG (see conftest.py). Every wait polls with a deadline."""
from __future__ import annotations

import urllib.request
from typing import Any

import pytest

from baton.operator import naming
from baton.operator.config import OperatorConfig
from baton.operator.kube import ApiError
from baton_testing.kube.cluster import Cluster
from baton_testing.kube.objects import for_create, isvc_body, written_version
from baton_testing.kube.runner import run_operator

pytestmark = pytest.mark.timeout(120)

PD_CHILDREN = [("ServiceAccount", "demo-router"), ("Role", "demo-router"), ("RoleBinding", "demo-router"),
               ("ConfigMap", "demo-topology"), ("Service", "demo-prefill"), ("Service", "demo-decode"),
               ("Service", "demo-router"), ("Deployment", "demo-prefill"), ("Deployment", "demo-decode"),
               ("Deployment", "demo-router")]
DEPLOYMENTS = ["demo-prefill", "demo-decode", "demo-router"]


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions", [])}


async def all_children(cluster: Cluster, ns: str, names=PD_CHILDREN) -> dict[tuple[str, str], dict]:
    async def probe():
        found = {key: await cluster.get(key[0], ns, key[1]) for key in names}
        return found if all(found.values()) else None
    return await cluster.wait_for(probe, f"children {names}")


async def condition_is(cluster: Cluster, ns: str, ctype: str, status: str, reason: str | None = None,
                       name: str = "demo") -> dict[str, Any]:
    async def probe():
        obj = await cluster.get("InferenceService", ns, name)
        c = conditions(obj).get(ctype, {})
        return obj if c.get("status") == status and reason in (None, c.get("reason")) else None
    return await cluster.wait_for(probe, f"{ctype}={status} ({reason})")


async def create_ready(cluster: Cluster, ns: str, **spec: Any) -> dict[str, Any]:
    await cluster.create(for_create(isvc_body(namespace=ns, **spec)))
    await all_children(cluster, ns)
    for name in DEPLOYMENTS:
        await cluster.settle(ns, name)
    return await condition_is(cluster, ns, "Ready", "True")


async def test_create_makes_owned_children_and_ready_follows_the_pods(cluster: Cluster, namespace: str):
    async with run_operator(cluster):
        await cluster.create(for_create(isvc_body(namespace=namespace)))
        children = await all_children(cluster, namespace)
        isvc = await cluster.get("InferenceService", namespace, "demo")
        for (kind, name), obj in children.items():
            [ref] = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
                ("InferenceService", "demo", isvc["metadata"]["uid"], True), (kind, name)
        if cluster.emulated:  # before any pod is ready
            obj = await condition_is(cluster, namespace, "Ready", "False", "NotServing")
            assert conditions(obj)["PrefillReady"]["reason"] == "PodsNotReady"
        for name in DEPLOYMENTS:
            await cluster.settle(namespace, name)
        obj = await condition_is(cluster, namespace, "Ready", "True", "Serving")
        st = obj["status"]
        assert st["endpoint"] == f"http://demo-router.{namespace}.svc:8000"
        assert (st["prefill"]["summary"], st["decode"]["summary"], st["router"]["summary"]) == ("1/1",) * 3
        assert st["observedGeneration"] == obj["metadata"]["generation"]
        assert conditions(obj)["Degraded"]["status"] == "False"


async def test_update_changes_only_the_right_deployment(cluster: Cluster, namespace: str):
    async with run_operator(cluster):
        await create_ready(cluster, namespace)
        before = await all_children(cluster, namespace)
        await cluster.patch("InferenceService", namespace, "demo",
                            {"spec": {"decode": {"replicas": 2, "extraArgs": ["--max-running-requests", "8"]}}})

        async def decode_updated():
            dep = await cluster.get("Deployment", namespace, "demo-decode")
            return dep if dep["spec"]["replicas"] == 2 else None
        dep = await cluster.wait_for(decode_updated, "decode Deployment patched")
        assert dep["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--max-running-requests", "8"]
        await condition_is(cluster, namespace, "Progressing", "True")
        after = await all_children(cluster, namespace)
        changed = {key for key in before
                   if written_version(after[key]) != written_version(before[key])}
        assert changed <= {("Deployment", "demo-decode"), ("ConfigMap", "demo-topology")}, changed
        assert ("Deployment", "demo-decode") in changed
        # the router's policy: only the router Deployment (and the topology) change
        before = after
        await cluster.patch("InferenceService", namespace, "demo", {"spec": {"router": {"decodePolicy": "random"}}})

        async def router_updated():
            d = await cluster.get("Deployment", namespace, "demo-router")
            return "random" in d["spec"]["template"]["spec"]["containers"][0]["args"]
        await cluster.wait_for(router_updated, "router Deployment patched")
        after = await all_children(cluster, namespace)
        changed = {key for key in before
                   if written_version(after[key]) != written_version(before[key])}
        assert ("Deployment", "demo-router") in changed
        assert not changed & {("Deployment", "demo-prefill"), ("Deployment", "demo-decode")}, changed


async def test_child_status_changes_drive_the_conditions(cluster: Cluster, namespace: str):
    async with run_operator(cluster):
        await create_ready(cluster, namespace)
        if not cluster.emulated:
            return  # a real control plane keeps the pods ready; losing one is the e2e suite's job
        await cluster.settle(namespace, "demo-decode", ready=0)
        obj = await condition_is(cluster, namespace, "Ready", "False", "NotServing")
        assert "no ready decode pod" in conditions(obj)["Ready"]["message"]
        assert conditions(obj)["DecodeReady"]["status"] == "False"
        await cluster.patch("Deployment", namespace, "demo-decode", {"status": {"conditions": [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
             "message": "ReplicaSet demo-decode-x has timed out progressing."}]}}, sub="status")
        obj = await condition_is(cluster, namespace, "Degraded", "True", "ProgressDeadlineExceeded")
        assert "kubectl" in conditions(obj)["Degraded"]["message"]
        await cluster.patch("Deployment", namespace, "demo-decode", {"status": {"conditions": []}}, sub="status")
        await cluster.settle(namespace, "demo-decode")
        await condition_is(cluster, namespace, "Ready", "True")
        await condition_is(cluster, namespace, "Degraded", "False")


async def test_delete_cascades_to_the_children(cluster: Cluster, namespace: str):
    async with run_operator(cluster) as memo:
        await cluster.create(for_create(isvc_body(namespace=namespace)))
        await all_children(cluster, namespace)
        await cluster.delete("InferenceService", namespace, "demo")

        async def gone():
            left = [k for k in PD_CHILDREN if await cluster.get(k[0], namespace, k[1]) is not None]
            return not left and await cluster.get("InferenceService", namespace, "demo") is None
        await cluster.wait_for(gone, "the InferenceService and its children gone", timeout=60)
        await cluster.wait_for(lambda: _zero(memo.metrics.value("baton_operator_managed_objects", kind="Deployment")),
                               "managed objects forgotten")


async def _zero(value: float) -> bool:
    return value == 0


async def test_invalid_spec_is_refused_with_a_reason(cluster: Cluster, namespace: str):
    bad = for_create(isvc_body(namespace=namespace, prefill={"tp": 2, "gpus": 1}))
    async with run_operator(cluster) as memo:
        if not cluster.emulated:  # a real API server evaluates the CRD's CEL rules itself
            with pytest.raises(ApiError) as info:
                await cluster.create(bad)
            assert info.value.status == 422 and "gpus must be 0" in info.value.message
            return
        await cluster.create(bad)
        obj = await condition_is(cluster, namespace, "Ready", "False", "InvalidSpec")
        c = conditions(obj)
        assert "spec.prefill: gpus must be 0 (run on CPU) or equal tp * dp" in c["Ready"]["message"]
        assert c["Degraded"]["reason"] == "InvalidSpec" and c["Progressing"]["status"] == "False"
        assert await cluster.get("Deployment", namespace, "demo-prefill") is None
        assert memo.metrics.value("baton_operator_errors_total", kind="invalid_spec") >= 1
        # fixing the spec recovers
        await cluster.patch("InferenceService", namespace, "demo", {"spec": {"prefill": {"tp": 1}}})
        await all_children(cluster, namespace)
        await condition_is(cluster, namespace, "Degraded", "False")


async def test_restart_is_idempotent_and_deleted_children_come_back(cluster: Cluster, namespace: str):
    async with run_operator(cluster):
        obj = await create_ready(cluster, namespace)
    # the internal key Secret too: created once, never rewritten (the operator cannot even read it)
    children = [*PD_CHILDREN, ("Secret", naming.internal_key_secret("demo", obj["metadata"]["uid"]))]
    before = await all_children(cluster, namespace, children)
    async with run_operator(cluster) as memo:
        await cluster.wait_for(lambda: _positive(memo.metrics.value(
            "baton_operator_reconciles_total", trigger="resume", result="ok")), "resume reconcile")
        after = await all_children(cluster, namespace, children)
        assert {k: written_version(o) for k, o in after.items()} == {k: written_version(o) for k, o in before.items()}
        await cluster.delete("Deployment", namespace, "demo-router")
        dep = await cluster.wait_for(lambda: cluster.get("Deployment", namespace, "demo-router"),
                                     "router Deployment recreated")
        assert dep["metadata"]["uid"] != before[("Deployment", "demo-router")]["metadata"]["uid"]


async def _positive(value: float) -> bool:
    return value > 0


async def test_mode_switch_keeps_the_old_roles_until_the_new_ones_serve(cluster: Cluster, namespace: str):
    """The new engine comes up beside the old roles; the router gets its new args once it is Ready; the
    old roles go once the router has rolled out: the service answers throughout."""
    def args(dep):
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]

    async with run_operator(cluster):
        await cluster.create(for_create(isvc_body(namespace=namespace)))
        await all_children(cluster, namespace)
        await cluster.patch("InferenceService", namespace, "demo",
                            {"spec": {"mode": "colocated", "prefill": None, "decode": None}})
        await all_children(cluster, namespace, [("Deployment", "demo-engine"), ("Service", "demo-engine")])
        if cluster.emulated:  # (real controllers may make the engine Ready at once)
            for name in ("demo-prefill", "demo-decode"):
                assert await cluster.get("Deployment", namespace, name) is not None
            assert "--pd-disaggregation" in args(await cluster.get("Deployment", namespace, "demo-router"))
            obj = await condition_is(cluster, namespace, "Progressing", "True", "SwitchingMode")
            assert "until the new engine pods are Ready" in conditions(obj)["Progressing"]["message"]
        await cluster.settle(namespace, "demo-engine")

        async def router_switched():
            return "--selector" in args(await cluster.get("Deployment", namespace, "demo-router"))
        await cluster.wait_for(router_switched, "the router's new args once the engine is Ready")
        if cluster.emulated:
            assert await cluster.get("Deployment", namespace, "demo-prefill") is not None
        await cluster.settle(namespace, "demo-router")

        async def pruned():
            return all([await cluster.get("Deployment", namespace, n) is None for n in ("demo-prefill", "demo-decode")])
        await cluster.wait_for(pruned, "prefill/decode Deployments pruned once the router rolled out")
        obj = await condition_is(cluster, namespace, "Ready", "True")
        assert obj["status"]["engine"]["summary"] == "1/1" and "prefill" not in obj["status"]


async def test_monitoring_objects_or_a_condition_saying_what_is_missing(cluster: Cluster, namespace: str,
                                                                       monitoring_crds: bool):
    async with run_operator(cluster):
        await create_ready(cluster, namespace, monitoring={"podMonitor": True, "serviceMonitor": True})
        try:
            has_crds = await cluster.get("PodMonitor", namespace, "demo") is not None
        except ApiError:
            has_crds = False
        if cluster.emulated:
            assert has_crds is monitoring_crds
        if has_crds:
            assert await cluster.get("ServiceMonitor", namespace, "demo") is not None
            await condition_is(cluster, namespace, "Degraded", "False")
        else:
            obj = await condition_is(cluster, namespace, "Degraded", "True", "MonitoringUnavailable")
            assert "turn off spec.monitoring" in conditions(obj)["Degraded"]["message"]
            assert conditions(obj)["Ready"]["status"] == "True"  # serving does not need monitoring


async def test_metrics_are_served(cluster: Cluster, namespace: str):
    config = OperatorConfig(resync_seconds=30, retry_seconds=0.5, metrics_port=0, metrics_addr="127.0.0.1")
    async with run_operator(cluster, config) as memo:
        await cluster.create(for_create(isvc_body(namespace=namespace)))
        await all_children(cluster, namespace)
        await cluster.wait_for(lambda: _positive(memo.metrics.value(
            "baton_operator_reconciles_total", trigger="create", result="ok")), "a counted reconcile")
        assert memo.metrics.value("baton_operator_managed_objects", kind="Deployment") == 3
        port = memo.metrics_server.server_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for name in ("baton_operator_reconciles_total", "baton_operator_errors_total",
                     "baton_operator_managed_objects", "baton_operator_reconcile_duration_seconds",
                     "baton_operator_inference_services"):
            assert name in text


async def test_events_are_posted_on_the_inference_service(cluster: Cluster, namespace: str):
    async with run_operator(cluster):
        await create_ready(cluster, namespace)

        async def events():
            found = [e for e in await cluster.list("Event", namespace)
                     if e.get("involvedObject", {}).get("kind") == "InferenceService"
                     and e["involvedObject"].get("name") == "demo"]
            return found if any("applied" in e.get("message", "") for e in found) else None
        found = await cluster.wait_for(events, "an Event on InferenceService demo saying what was applied")
        assert any("Deployment/demo-decode" in e["message"] for e in found)
