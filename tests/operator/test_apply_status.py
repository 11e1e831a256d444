"""Pure parts of reconciling: the merge patch sent to children, and the status computed from them."""
from __future__ import annotations

from baton.operator import naming
from baton.operator.apply import merge_patch
from baton.operator.naming import Role
from baton.operator.spec import parse
from baton.operator.status import compute_status, invalid_status
from baton_testing.kube.objects import isvc_body

NOW = "2026-01-01T00:00:00Z"


def test_merge_patch_removes_dropped_keys_and_keeps_foreign_metadata():
    live = {"apiVersion": "v1", "kind": "X",
            "metadata": {"name": "a", "uid": "1", "labels": {"ours": "1", "theirs": "x"},
                         "annotations": {"deployment.kubernetes.io/revision": "3"}},
            "spec": {"replicas": 2, "nodeSelector": {"gpu": "a100"}, "template": {"c": [1, 2]}},
            "status": {"ready": 2}}
    desired = {"apiVersion": "v1", "kind": "X", "metadata": {"name": "a", "labels": {"ours": "2"}},
               "spec": {"replicas": 2, "template": {"c": [1, 3]}}}
    assert merge_patch(live, desired) == {"metadata": {"labels": {"ours": "2"}},
                                          "spec": {"nodeSelector": None, "template": {"c": [1, 3]}}}


def test_merge_patch_of_an_equal_object_is_empty():
    obj = {"apiVersion": "v1", "kind": "X", "metadata": {"name": "a", "ownerReferences": [{"uid": "u"}]},
           "data": {"k": "v"}}
    assert merge_patch(obj, obj) == {}


def deployment(replicas: int, ready: int, updated: int | None = None, generation: int = 1,
               observed: int = 1, conditions: list | None = None) -> dict:
    updated = replicas if updated is None else updated
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": observed, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": updated, "availableReplicas": ready,
                       "conditions": conditions or []}}


def conds(status: dict) -> dict:
    return {c["type"]: c for c in status["conditions"]}


def test_all_roles_ready_means_ready_and_rolled_out():
    isvc = parse(isvc_body())
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(2, 2), Role.ROUTER: deployment(1, 1)}
    st = compute_status(isvc, deps, {}, NOW, observed_generation=1)
    c = conds(st)
    assert {t: c[t]["status"] for t in c} == {"Ready": "True", "PrefillReady": "True", "DecodeReady": "True",
                                             "RouterReady": "True", "Progressing": "False", "Degraded": "False",
                                             "Reconciled": "True"}
    assert st["decode"] == {"desiredReplicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                            "availableReplicas": 2, "summary": "2/2"}
    assert st["endpoint"] == "http://demo-router.default.svc:8000" and st["observedGeneration"] == 1
    assert "serving model 'tiny'" in c["Ready"]["message"]


def test_no_ready_decode_pod_means_not_ready_and_says_where_to_look():
    isvc = parse(isvc_body())
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(2, 0), Role.ROUTER: deployment(1, 1)}
    c = conds(compute_status(isvc, deps, {}, NOW, 1))
    assert c["Ready"]["status"] == "False" and c["Ready"]["reason"] == "NotServing"
    assert "no ready decode pod" in c["Ready"]["message"] and "DecodeReady" in c["Ready"]["message"]
    assert c["DecodeReady"]["reason"] == "PodsNotReady"
    assert "kubectl -n default describe pods -l baton.dev/inference-service=demo,baton.dev/role=decode" in \
        c["DecodeReady"]["message"]
    assert c["Progressing"]["status"] == "True" and c["Progressing"]["reason"] == "RollingOut"


def test_router_not_ready_means_not_ready_even_with_engines_up():
    isvc = parse(isvc_body())
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 1), Role.ROUTER: deployment(1, 0)}
    c = conds(compute_status(isvc, deps, {}, NOW, 1))
    assert c["Ready"]["status"] == "False" and c["RouterReady"]["status"] == "False"


def test_partial_capacity_is_ready_but_says_so():
    isvc = parse(isvc_body())
    deps = {Role.PREFILL: deployment(2, 1), Role.DECODE: deployment(1, 1), Role.ROUTER: deployment(1, 1)}
    c = conds(compute_status(isvc, deps, {}, NOW, 1))
    assert c["Ready"]["status"] == "True" and "reduced capacity (1/2 prefill" in c["Ready"]["message"]
    assert c["PrefillReady"]["status"] == "False"


def test_stuck_rollout_is_degraded_with_the_deployment_message():
    stuck = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
              "message": 'ReplicaSet "demo-decode-1" has timed out progressing.'}]
    isvc = parse(isvc_body())
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 0, conditions=stuck),
            Role.ROUTER: deployment(1, 1)}
    c = conds(compute_status(isvc, deps, {}, NOW, 1))
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "ProgressDeadlineExceeded"
    assert "timed out progressing" in c["DecodeReady"]["message"]
    assert c["Progressing"]["status"] == "False"


def test_missing_deployment_and_scaled_to_zero():
    isvc = parse(isvc_body(prefill={"replicas": 0}))
    deps = {Role.PREFILL: deployment(0, 0), Role.DECODE: None, Role.ROUTER: deployment(1, 1)}
    c = conds(compute_status(isvc, deps, {}, NOW, 1))
    assert c["PrefillReady"]["reason"] == "ScaledToZero" and "at least 1" in c["PrefillReady"]["message"]
    assert c["DecodeReady"]["reason"] == "DeploymentMissing"


def test_colocated_status_uses_the_engine_role():
    isvc = parse(isvc_body(mode="colocated"))
    st = compute_status(isvc, {Role.COLOCATED: deployment(1, 1), Role.ROUTER: deployment(1, 1)}, {}, NOW, 1)
    assert st["engine"]["summary"] == "1/1" and "prefill" not in st
    assert conds(st)["EngineReady"]["status"] == "True" and conds(st)["Ready"]["status"] == "True"


def test_a_mode_switch_stays_ready_while_the_old_roles_serve():
    """PD -> colocated: the new engine is not Ready yet, the old prefill and decode (and the router,
    still routing to them) are: the service answers, so Ready stays True and says how; Progressing says
    SwitchingMode. Without a ready old role, or without the router, it is not Ready."""
    isvc = parse(isvc_body(mode="colocated"))
    deps = {Role.COLOCATED: deployment(1, 0), Role.ROUTER: deployment(1, 1), Role.PREFILL: deployment(1, 1),
            Role.DECODE: deployment(1, 1)}
    c = conds(compute_status(isvc, deps, {}, NOW, 1, switching="the new engine pods are Ready"))
    assert c["Ready"]["status"] == "True" and "previous mode" in c["Ready"]["message"], c["Ready"]
    assert c["Progressing"]["reason"] == "SwitchingMode" and c["EngineReady"]["status"] == "False"
    for broken in (Role.DECODE, Role.ROUTER):
        c = conds(compute_status(isvc, {**deps, broken: deployment(1, 0)}, {}, NOW, 1, switching="x"))
        assert c["Ready"]["status"] == "False", broken


def test_transition_time_moves_only_when_the_status_flips():
    isvc = parse(isvc_body())
    ready = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 1), Role.ROUTER: deployment(1, 1)}
    first = compute_status(isvc, ready, {}, "t1", 1)
    again = compute_status(isvc, ready, first, "t2", 1)
    assert conds(again)["Ready"]["lastTransitionTime"] == "t1"
    down = compute_status(isvc, {**ready, Role.ROUTER: deployment(1, 0)}, again, "t3", 1)
    assert conds(down)["Ready"]["lastTransitionTime"] == "t3"


def test_newer_spec_than_applied_is_progressing():
    body = isvc_body()
    body["metadata"]["generation"] = 2
    isvc = parse(body)
    ready = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 1), Role.ROUTER: deployment(1, 1)}
    c = conds(compute_status(isvc, ready, {}, NOW, observed_generation=1))
    assert c["Progressing"]["status"] == "True" and c["Progressing"]["reason"] == "Reconciling"


def test_invalid_status_tells_what_to_fix():
    st = invalid_status({}, ["spec.prefill: gpus must be 0"], 3, NOW)
    c = conds(st)
    assert c["Ready"]["reason"] == "InvalidSpec" and c["Degraded"]["status"] == "True"
    assert "fix it and apply again: spec.prefill: gpus must be 0" in c["Degraded"]["message"]
    assert st["observedGeneration"] == 3


def test_a_replica_failure_is_not_masked_by_missing_monitoring_crds():
    forbidden = [{"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                  "message": 'pods "demo-decode-x" is forbidden: violates PodSecurity "restricted:latest"'}]
    isvc = parse(isvc_body(monitoring={"podMonitor": True}))
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 0, conditions=forbidden),
            Role.ROUTER: deployment(1, 1)}
    problem = ("MonitoringUnavailable", "PodMonitor cannot be created: install the Prometheus Operator CRDs")
    c = conds(compute_status(isvc, deps, {}, NOW, 1, problem))
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "ReplicaFailure")
    assert "violates PodSecurity" in c["Degraded"]["message"]
    assert "PodMonitor cannot be created" in c["Degraded"]["message"]  # both said
    assert c["Reconciled"]["reason"] == "MonitoringUnavailable"  # kept apart for later refreshes


def as_stored(obj):
    """`obj` roughly as a real API server returns it: empty and false fields dropped, defaults added,
    quantities in canonical form, a status."""
    if isinstance(obj, dict):
        out = {k: as_stored(v) for k, v in obj.items() if v not in (None, False, 0, "", [], {})}
        if "containerPort" in out:
            out.setdefault("protocol", "TCP")
        if "image" in out:
            out.update(terminationMessagePath="/dev/termination-log", imagePullPolicy="IfNotPresent")
        if "httpGet" in out:
            out = {"timeoutSeconds": 1, "periodSeconds": 10, "successThreshold": 1, **out}
            out["httpGet"] = {**out["httpGet"], "scheme": "HTTP"}
        if "fieldPath" in out:
            out.setdefault("apiVersion", "v1")
        return out
    if isinstance(obj, list):
        return [as_stored(v) for v in obj]
    return obj


def test_a_child_as_the_api_server_stores_it_has_not_drifted_and_edits_by_others_have():
    from baton.operator.apply import drift
    from baton.operator.builders import build_children

    isvc = parse(isvc_body(decode={"resources": {"requests": {"cpu": 0.5, "memory": "1024Mi"}}}))
    for want in build_children(isvc):
        live = as_stored(want)
        live["metadata"].update(uid="u", resourceVersion="7", labels={**live["metadata"]["labels"], "x": "y"})
        if want["kind"] == "Deployment":
            for key, value in (("revisionHistoryLimit", 10), ("progressDeadlineSeconds", 600),
                               ("strategy", {"type": "RollingUpdate"})):
                live["spec"].setdefault(key, value)
            live["spec"]["template"]["spec"].update(dnsPolicy="ClusterFirst", schedulerName="default-scheduler")
            live["status"] = {"replicas": 1, "readyReplicas": 1}
            for c in live["spec"]["template"]["spec"]["containers"]:
                for kind in c.get("resources", {}).values():
                    if kind.get("cpu") == 0.5:
                        kind["cpu"] = "500m"
        assert not drift(live, want), want["metadata"]["name"]

    def edited(kind: str, name: str, change) -> bool:
        want = next(o for o in build_children(isvc) if (o["kind"], o["metadata"]["name"]) == (kind, name))
        live = as_stored(want)
        change(live)
        return drift(live, want)

    def image(d):
        d["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:latest"

    def widen(r):
        r["rules"][0]["verbs"].append("create")

    def more_rules(r):
        r["rules"].append({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]})

    def elsewhere(s):
        s["spec"]["selector"] = {"app": "other"}

    def narrower(s):
        s["spec"]["selector"]["extra"] = "x"

    def any_namespace(n):  # the router's peer, from every namespace
        n["spec"]["ingress"][0]["from"][0]["namespaceSelector"] = {"matchLabels": {"team": "other"}}

    def fewer_pods(n):  # the policy no longer covering the decode pods
        n["spec"]["podSelector"]["matchLabels"]["baton.dev/role"] = "prefill"

    assert edited("Deployment", "demo-decode", image)
    assert edited("NetworkPolicy", "demo-engines", any_namespace) and edited("NetworkPolicy", "demo-engines", fewer_pods)
    assert edited("Role", "demo-router", widen) and edited("Role", "demo-router", more_rules)
    assert edited("Service", "demo-router", elsewhere) and edited("Service", "demo-router", narrower)


GPU_SHORTAGE = "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available"


def pod(role: Role, name: str, unschedulable: str | None = None, service: str = "demo") -> dict:
    scheduled = ({"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
                 if unschedulable else {"type": "PodScheduled", "status": "True"})
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default",
                         "labels": {**naming.selector_labels(service, role), "pod-template-hash": "abc"}},
            "status": {"phase": "Pending" if unschedulable else "Running", "conditions": [scheduled]}}


def test_unschedulable_pods_say_why_instead_of_loading_the_model():
    isvc = parse(isvc_body(decode={"replicas": 2}))
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(2, 0), Role.ROUTER: deployment(1, 1)}
    pods = [pod(Role.PREFILL, "demo-prefill-a"),
            pod(Role.DECODE, "demo-decode-a", GPU_SHORTAGE + "."), pod(Role.DECODE, "demo-decode-b", GPU_SHORTAGE),
            pod(Role.PREFILL, "other-prefill-a", "0/3 nodes: something else", service="other")]
    c = conds(compute_status(isvc, deps, {}, NOW, 1, pods=pods))
    decode = c["DecodeReady"]
    assert (decode["status"], decode["reason"]) == ("False", "Unschedulable")
    assert "2 decode pods cannot be scheduled: " + GPU_SHORTAGE in decode["message"]
    assert "spec.decode" in decode["message"] and "loading the model" not in decode["message"]
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("False", "Unschedulable")
    assert GPU_SHORTAGE in c["Ready"]["message"]
    assert (c["Progressing"]["status"], c["Progressing"]["reason"]) == ("False", "Unschedulable")
    assert GPU_SHORTAGE in c["Progressing"]["message"]
    assert (c["Degraded"]["status"], c["Degraded"]["reason"]) == ("True", "Unschedulable")
    assert c["PrefillReady"]["reason"] == "AllReady"  # another service's pods do not count


def test_one_unschedulable_pod_of_a_serving_role_is_reduced_capacity():
    isvc = parse(isvc_body(decode={"replicas": 2}))
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(2, 1), Role.ROUTER: deployment(1, 1)}
    pods = [pod(Role.DECODE, "demo-decode-a"), pod(Role.DECODE, "demo-decode-b", GPU_SHORTAGE)]
    c = conds(compute_status(isvc, deps, {}, NOW, 1, pods=pods))
    assert (c["Ready"]["status"], c["Ready"]["reason"]) == ("True", "Serving")
    assert "1 decode pod cannot be scheduled: " + GPU_SHORTAGE in c["DecodeReady"]["message"]
    assert c["Degraded"]["reason"] == "Unschedulable"


def router_service(ingress: list | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "demo-router", "namespace": "default"},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}]},
            "status": {"loadBalancer": {"ingress": ingress} if ingress is not None else {}}}


def test_a_load_balancer_endpoint_is_its_address_once_it_has_one():
    isvc = parse(isvc_body(router={"service": {"type": "LoadBalancer", "port": 80}}))
    ready = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 1), Role.ROUTER: deployment(1, 1)}
    in_cluster = "http://demo-router.default.svc:80"
    for service in (None, router_service(), router_service([])):
        st = compute_status(isvc, ready, {}, NOW, 1, router_service=service)
        assert st["endpoint"] == "<pending>" and st["clusterEndpoint"] == in_cluster
        ready_msg = conds(st)["Ready"]["message"]
        assert in_cluster in ready_msg and "load balancer has no address yet" in ready_msg
    for ingress, url in (([{"ip": "203.0.113.7"}], "http://203.0.113.7:80"),
                         ([{"hostname": "a1b2.elb.example.com"}], "http://a1b2.elb.example.com:80"),
                         ([{"ip": "2001:db8::7"}], "http://[2001:db8::7]:80")):
        st = compute_status(isvc, ready, {}, NOW, 1, router_service=router_service(ingress))
        assert (st["endpoint"], st["clusterEndpoint"]) == (url, in_cluster)
        assert f"serving model 'tiny' at {url}" in conds(st)["Ready"]["message"]


def test_a_cluster_ip_endpoint_is_the_in_cluster_url():
    isvc = parse(isvc_body())
    ready = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 1), Role.ROUTER: deployment(1, 1)}
    st = compute_status(isvc, ready, {}, NOW, 1, router_service=router_service([{"ip": "203.0.113.7"}]))
    assert st["endpoint"] == st["clusterEndpoint"] == "http://demo-router.default.svc:8000"
