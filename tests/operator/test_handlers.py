"""kopf handlers called directly on an in-memory client: what the status says after scripted API answers."""
from __future__ import annotations

import dataclasses
import logging

import kopf
import pytest

from baton.operator import handlers
from baton.operator.builders import build_children
from baton.operator.kube import ApiError
from baton.operator.spec import parse
from baton_testing.kube.fake_client import LOGGER, FakeClient, memo_for
from baton_testing.kube.objects import isvc_body


def conditions(obj: dict) -> dict[str, dict]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


def refuse_deployments(obj: dict) -> ApiError | None:
    if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "demo-decode":
        return ApiError(422, "Invalid", 'Deployment.apps "demo-decode" is invalid: spec.template.spec.'
                                        'tolerations[0].operator: Unsupported value: "Equal2"')
    return None


async def child_event(client: FakeClient, memo: kopf.Memo, name: str, event_type: str = "MODIFIED") -> None:
    dep = client.find("Deployment", "default", name)
    await handlers.child_deployment_event(event={"type": event_type, "object": dep}, body=dep, memo=memo,
                                          logger=LOGGER)


async def test_api_refused_survives_the_status_refresh_of_a_deployment_event():
    client = FakeClient(refuse=refuse_deployments)
    memo = memo_for(client)
    client.put(isvc_body())
    with pytest.raises(kopf.PermanentError):
        await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    c = conditions(client.find("InferenceService", "default", "demo"))
    assert (c["Degraded"]["reason"], c["Ready"]["reason"]) == ("ApiRefused", "ApiRefused")
    # the prefill Deployment was created before the decode's was refused: its events refresh the status
    await child_event(client, memo, "demo-prefill")
    c = conditions(client.find("InferenceService", "default", "demo"))
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ApiRefused")
    assert "Unsupported value" in c["Degraded"]["message"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "ApiRefused")
    assert c["Progressing"]["reason"] == "ApiRefused"
    # a fixed spec clears it
    client.refuse = lambda obj: None
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "update")
    await child_event(client, memo, "demo-prefill")
    c = conditions(client.find("InferenceService", "default", "demo"))
    assert c["Degraded"]["reason"] != "ApiRefused" and c["Ready"]["reason"] != "ApiRefused"


async def test_edits_of_children_by_others_are_put_back_and_said():
    client = FakeClient()
    memo = memo_for(client)
    client.put(isvc_body())
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    want = {key: client.find(*key) for key in [("Deployment", "default", "demo-decode"),
                                               ("Role", "default", "demo-router"),
                                               ("Service", "default", "demo-router")]}
    # an image changed by hand: the Deployment's own event puts it back
    client.objects[("Deployment", "default", "demo-decode")]["spec"]["template"]["spec"]["containers"][0][
        "image"] = "someone/else:latest"
    await child_event(client, memo, "demo-decode")
    assert client.find("Deployment", "default", "demo-decode")["spec"] == want[("Deployment", "default", "demo-decode")]["spec"]
    # a widened Role and a Service pointed elsewhere: the next reconcile (the resync) puts them back
    client.objects[("Role", "default", "demo-router")]["rules"][0]["verbs"].append("create")
    client.objects[("Service", "default", "demo-router")]["spec"]["selector"] = {"app": "elsewhere"}
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "resync")
    assert client.find("Role", "default", "demo-router")["rules"] == want[("Role", "default", "demo-router")]["rules"]
    assert client.find("Service", "default", "demo-router")["spec"]["selector"] == \
        want[("Service", "default", "demo-router")]["spec"]["selector"]
    assert memo.metrics.value("baton_operator_reconciles_total", trigger="child-drifted", result="ok") == 1


async def test_children_left_by_a_deleted_service_of_the_same_name_are_replaced_not_name_taken():
    client = FakeClient()
    memo = memo_for(client)
    old = isvc_body()
    old["metadata"]["uid"] = "uid-of-the-deleted-one"
    for child in build_children(parse(old)):  # garbage collection has not reached them yet
        client.put(child)
    client.put(isvc_body())  # re-created: a new uid
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    for key, obj in client.objects.items():
        if key[0] != "InferenceService":
            assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-demo", key
    c = conditions(client.find("InferenceService", "default", "demo"))
    assert c["Degraded"]["reason"] != "NameTaken"


def internal_key_refs(client: FakeClient) -> set[str]:
    """The Secrets the service's pods take their keys from (BATON_API_KEY, BATON_ENGINE_API_KEY)."""
    refs = set()
    for (kind, _, _), obj in client.objects.items():
        if kind == "Deployment":
            for env in obj["spec"]["template"]["spec"]["containers"][0]["env"]:
                if env["name"] in ("BATON_API_KEY", "BATON_ENGINE_API_KEY"):
                    refs.add(env["valueFrom"]["secretKeyRef"]["name"])
    return refs


async def test_the_internal_key_is_created_once_kept_across_reconciles_and_never_logged(caplog):
    caplog.set_level(logging.DEBUG)
    client = FakeClient()
    memo = memo_for(client)
    client.put(isvc_body())
    secrets = []
    for trigger in ("create", "resync", "resume"):
        await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, trigger)
        secrets.append([o for (kind, _, _), o in client.objects.items() if kind == "Secret"])
    assert secrets[0] == secrets[1] == secrets[2]  # created by the first reconcile, never written again
    [secret] = secrets[0]
    key = secret["stringData"]["api-key"]
    assert len(key) >= 40 and secret["immutable"] is True and secret["type"] == "Opaque"
    assert secret["metadata"]["name"] == "demo-internal-key-uid-demo"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"  # garbage-collected with the service
    assert internal_key_refs(client) == {"demo-internal-key-uid-demo"}
    assert key not in caplog.text
    # deleted and created again under the same name before garbage collection ran: a key of its own
    again = isvc_body()
    again["metadata"]["uid"] = "uid-again"
    client.put(again)
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    assert internal_key_refs(client) == {"demo-internal-key-uid-agai"}
    assert client.find("Secret", "default", "demo-internal-key-uid-agai")["stringData"]["api-key"] != key


async def test_the_network_policy_lets_the_planner_in_from_the_operators_namespace_and_goes_when_turned_off():
    client = FakeClient()
    memo = memo_for(client)
    memo["config"] = dataclasses.replace(memo.config, operator_namespace="baton-system")
    client.put(isvc_body(autoscaling={"mode": "planner", "decode": {"targetKVUsage": 0.7}}))
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    [planner] = client.find("NetworkPolicy", "default", "demo-engines")["spec"]["ingress"][2]["from"]
    assert planner["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "baton-system"}}
    client.objects[("InferenceService", "default", "demo")]["spec"]["networkPolicy"] = {"enabled": False}
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "update")
    assert client.find("NetworkPolicy", "default", "demo-engines") is None
    assert ("NetworkPolicy", "default", "demo-engines") in client.deleted


async def test_a_child_name_taken_by_a_foreign_object_stays_name_taken():
    client = FakeClient()
    memo = memo_for(client)
    client.put({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "demo-router", "namespace": "default"}})
    other = isvc_body(name="other")
    client.put({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "demo-topology", "namespace": "default",
        "ownerReferences": build_children(parse(other))[0]["metadata"]["ownerReferences"]}})
    client.put(isvc_body())
    with pytest.raises(kopf.TemporaryError):
        await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    assert conditions(client.find("InferenceService", "default", "demo"))["Degraded"]["reason"] == "NameTaken"
    assert client.find("Service", "default", "demo-router")["metadata"].get("ownerReferences") is None
    assert client.find("ConfigMap", "default", "demo-topology")["metadata"]["ownerReferences"][0]["name"] == "other"


async def test_the_status_refresh_reads_the_scheduler_verdict_from_the_pods():
    client = FakeClient()
    memo = memo_for(client)
    client.put(isvc_body(decode={"gpus": 8, "dp": 8, "replicas": 1024}))
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    before = conditions(client.find("InferenceService", "default", "demo"))["DecodeReady"]
    assert "loading the model" in before["message"]  # no pod yet: nothing says otherwise
    shortage = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    client.put({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "demo-decode-x", "namespace": "default",
        "labels": {"baton.dev/inference-service": "demo", "baton.dev/role": "decode"}},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                       "reason": "Unschedulable", "message": shortage}]}})
    await child_event(client, memo, "demo-decode")
    c = conditions(client.find("InferenceService", "default", "demo"))
    assert (c["DecodeReady"]["reason"], c["Ready"]["reason"]) == ("Unschedulable", "Unschedulable")
    assert shortage.rstrip(".") in c["Ready"]["message"] and "loading the model" not in c["DecodeReady"]["message"]


async def test_the_status_refresh_reads_the_load_balancer_address():
    client = FakeClient()
    memo = memo_for(client)
    client.put(isvc_body(router={"service": {"type": "LoadBalancer"}}))
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    assert client.find("InferenceService", "default", "demo")["status"]["endpoint"] == "<pending>"
    client.objects[("Service", "default", "demo-router")]["status"] = {
        "loadBalancer": {"ingress": [{"ip": "203.0.113.7"}]}}
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "resync")
    st = client.find("InferenceService", "default", "demo")["status"]
    assert (st["endpoint"], st["clusterEndpoint"]) == ("http://203.0.113.7:8000", "http://demo-router.default.svc:8000")


async def test_external_autoscaling_leaves_engine_replicas_to_the_autoscaler():
    """spec.autoscaling.mode external: what an HPA or KEDA sets through the scale subresource stays, through
    the Deployment's own event, a spec change and a resync; static mode puts spec.<role>.replicas back."""
    from baton.operator import naming

    client = FakeClient()
    memo = memo_for(client)
    client.put(isvc_body(autoscaling={"mode": "external"}, decode={"replicas": 2}))
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "create")
    key = ("Deployment", "default", "demo-decode")
    assert client.find(*key)["spec"]["replicas"] == 2  # created with spec.decode.replicas
    assert client.find(*key)["metadata"]["annotations"][naming.REPLICAS_ANNOTATION] == "external"

    client.objects[key]["spec"]["replicas"] = 5  # the HPA scales decode out
    await child_event(client, memo, "demo-decode")
    assert client.find(*key)["spec"]["replicas"] == 5
    spec = client.objects[("InferenceService", "default", "demo")]["spec"]
    spec["decode"] = {"replicas": 1, "extraArgs": ["--max-running-requests", "8"]}
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "update")
    dep = client.find(*key)
    assert dep["spec"]["template"]["spec"]["containers"][0]["args"][-2:] == ["--max-running-requests", "8"]
    assert dep["spec"]["replicas"] == 5, "a spec change does not reset what the autoscaler set"
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "resync")
    assert client.find(*key)["spec"]["replicas"] == 5
    c = conditions(client.find("InferenceService", "default", "demo"))
    assert "/5" in c["DecodeReady"]["message"], "the status counts the autoscaler's replicas"
    assert client.find("Deployment", "default", "demo-router")["spec"]["replicas"] == 1  # router: its own count

    # back to static: spec.decode.replicas rules again, and the annotation goes
    spec["autoscaling"] = {"mode": "static"}
    await handlers.run_reconcile(client.find("InferenceService", "default", "demo"), memo, LOGGER, "update")
    dep = client.find(*key)
    assert dep["spec"]["replicas"] == 1
    assert naming.REPLICAS_ANNOTATION not in (dep["metadata"].get("annotations") or {})
    client.objects[key]["spec"]["replicas"] = 4  # now a hand-made scale is drift
    await child_event(client, memo, "demo-decode")
    assert client.find(*key)["spec"]["replicas"] == 1
