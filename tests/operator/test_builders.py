"""Pure builders: every engine role, every kvTransfer mode, colocated mode, router, RBAC, monitors."""
from __future__ import annotations

import json

import pytest

from baton.operator import naming
from baton.operator.apply import keep_live_replicas
from baton.operator.builders import build_children
from baton.operator.builders.common import spec_hash
from baton.operator.builders.engine import engine_args, engine_deployment, engine_service
from baton.operator.builders.monitoring import pod_monitor, service_monitor
from baton.operator.builders.router import (router_args, router_deployment, router_role,
                                            router_role_binding, router_service)
from baton.operator.naming import Role
from baton.operator.spec import parse
from baton_testing.kube.objects import isvc_body


def container(dep: dict) -> dict:
    return dep["spec"]["template"]["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_pd_engine_runs_baton_serve_with_its_role_flags(role):
    isvc = parse(isvc_body(**{role.value: {"replicas": 3, "dp": 2, "extraArgs": ["--mem-fraction-static", "0.8"]}}))
    dep = engine_deployment(isvc, role)
    c = container(dep)
    assert c["command"] == ["baton", "serve"]
    args = c["args"]
    assert flag(args, "--model-path") == "/models/tiny" and flag(args, "--served-model-name") == "tiny"
    assert flag(args, "--host") == "0.0.0.0" and flag(args, "--port") == "30000"
    assert flag(args, "--tp-size") == "1" and flag(args, "--dp-size") == "2" and flag(args, "--device") == "cpu"
    assert flag(args, "--disaggregation-mode") == role.value
    assert flag(args, "--disaggregation-bootstrap-port") == "8998"
    assert flag(args, "--disaggregation-transfer-backend") == "mooncake"
    assert flag(args, "--disaggregation-protocol") == "tcp"
    assert "--disaggregation-ib-device" not in args
    assert args[-2:] == ["--mem-fraction-static", "0.8"]
    assert dep["spec"]["replicas"] == 3
    assert dep["metadata"]["name"] == f"demo-{role.value}"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


def test_model_dtypes_and_parsers_reach_every_engine_role_as_flags_the_engine_accepts():
    import argparse

    from baton.engine.server_args import ServerArgs

    model = {"name": "tiny", "path": "/models/tiny", "dtype": "bfloat16", "kvCacheDtype": "fp8_e5m2",
             "toolCallParser": "qwen25", "reasoningParser": "qwen3"}
    for mode, roles in (("disaggregated", (Role.PREFILL, Role.DECODE)), ("colocated", (Role.COLOCATED,))):
        isvc = parse(isvc_body(mode=mode, model=model))
        for role in roles:
            args = engine_args(isvc, role)
            assert flag(args, "--dtype") == "bfloat16" and flag(args, "--kv-cache-dtype") == "fp8_e5m2"
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)
            server_args = ServerArgs.from_cli_args(parser.parse_args(args))
            assert (server_args.dtype, server_args.kv_cache_dtype) == ("bfloat16", "fp8_e5m2")
            assert (server_args.tool_call_parser, server_args.reasoning_parser) == ("qwen25", "qwen3")
    # auto (the default) adds no flag: the engine's default is auto, and existing pods keep their args
    args = engine_args(parse(isvc_body()), Role.DECODE)
    assert not {"--dtype", "--kv-cache-dtype", "--tool-call-parser", "--reasoning-parser"} & set(args)


def test_termination_grace_period_per_role():
    isvc = parse(isvc_body(decode={"terminationGracePeriodSeconds": 900}))
    pods = {role: engine_deployment(isvc, role)["spec"]["template"]["spec"] for role in (Role.PREFILL, Role.DECODE)}
    assert pods[Role.DECODE]["terminationGracePeriodSeconds"] == 900
    assert pods[Role.PREFILL]["terminationGracePeriodSeconds"] == 60  # the default


def test_prefill_exposes_the_bootstrap_port_and_annotation_decode_does_not():
    isvc = parse(isvc_body(kvTransfer={"bootstrapPort": 9000}))
    prefill, decode = engine_deployment(isvc, Role.PREFILL), engine_deployment(isvc, Role.DECODE)
    ports = {p["name"]: p["containerPort"] for p in container(prefill)["ports"]}
    assert ports == {"http": 30000, "bootstrap": 9000}
    assert prefill["spec"]["template"]["metadata"]["annotations"][naming.BOOTSTRAP_PORT_ANNOTATION] == "9000"
    assert {p["name"] for p in container(decode)["ports"]} == {"http"}
    assert naming.BOOTSTRAP_PORT_ANNOTATION not in decode["spec"]["template"]["metadata"]["annotations"]
    svc = engine_service(isvc, Role.PREFILL)
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"http": 30000, "bootstrap": 9000}


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE, Role.COLOCATED, Role.ROUTER])
def test_pods_carry_the_labels_the_router_selects_on_and_an_owner_reference(role):
    mode = "colocated" if role is Role.COLOCATED else "disaggregated"
    isvc = parse(isvc_body(mode=mode))
    dep = router_deployment(isvc) if role is Role.ROUTER else engine_deployment(isvc, role)
    selector = {naming.SERVICE_LABEL: "demo", naming.ROLE_LABEL: role.value}
    assert dep["spec"]["selector"]["matchLabels"] == selector
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()
    assert labels["app.kubernetes.io/managed-by"] == "baton-operator"
    assert labels["app.kubernetes.io/instance"] == "demo"
    [owner] = dep["metadata"]["ownerReferences"]
    assert owner == {"apiVersion": "baton.dev/v1alpha1", "kind": "InferenceService", "name": "demo",
                     "uid": "uid-demo", "controller": True, "blockOwnerDeletion": True}


def test_rdma_mode_sets_devices_resources_and_ipc_lock():
    isvc = parse(isvc_body(prefill={"gpus": 2, "dp": 2}, decode={"gpus": 1},
                           kvTransfer={"protocol": "rdma", "ibDevices": ["mlx5_0", "mlx5_1"],
                                       "rdmaResourceName": "rdma/hca_shared_devices_a", "rdmaResourceCount": 2}))
    for role, gpus in ((Role.PREFILL, 2), (Role.DECODE, 1)):
        c = container(engine_deployment(isvc, role))
        assert flag(c["args"], "--disaggregation-protocol") == "rdma"
        assert flag(c["args"], "--disaggregation-ib-device") == "mlx5_0,mlx5_1"
        assert flag(c["args"], "--device") == "cuda"
        assert c["resources"]["limits"] == {"nvidia.com/gpu": gpus, "rdma/hca_shared_devices_a": 2}
        assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_rdma_without_explicit_devices_lets_mooncake_pick():
    isvc = parse(isvc_body(kvTransfer={"protocol": "rdma"}))
    c = container(engine_deployment(isvc, Role.DECODE))
    assert flag(c["args"], "--disaggregation-protocol") == "rdma"
    assert "--disaggregation-ib-device" not in c["args"]
    assert "rdma" not in json.dumps(c["resources"])


def test_tcp_mode_keeps_the_container_unprivileged_and_non_root():
    isvc = parse(isvc_body())
    dep = engine_deployment(isvc, Role.DECODE)
    c, pod = container(dep), dep["spec"]["template"]["spec"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000
    assert pod["automountServiceAccountToken"] is False
    assert "hostNetwork" not in pod


def test_root_is_allowed_when_the_image_needs_it():
    isvc = parse(isvc_body(podSecurity={"runAsNonRoot": False}))
    pod = engine_deployment(isvc, Role.PREFILL)["spec"]["template"]["spec"]
    assert "runAsNonRoot" not in pod["securityContext"]


def test_host_network_mode_for_engines_only():
    isvc = parse(isvc_body(kvTransfer={"hostNetwork": True}))
    for role in (Role.PREFILL, Role.DECODE):
        dep = engine_deployment(isvc, role)
        assert dep["spec"]["template"]["spec"]["hostNetwork"] is True
        assert dep["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert "hostNetwork" not in router_deployment(isvc)["spec"]["template"]["spec"]


def test_rollouts_surge_by_default_and_in_place_when_asked():
    """New pods Ready before old ones go, on every role (GPU ones too: a rollout then waits for a spare GPU
    rather than leave a role without a serving pod), unless the role asks to be replaced in place."""
    isvc = parse(isvc_body(prefill={"gpus": 1}, decode={"gpus": 1, "rollingUpdate": {"maxSurge": 0,
                                                                                    "maxUnavailable": "25%"}}))
    assert engine_deployment(isvc, Role.PREFILL)["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert engine_deployment(isvc, Role.DECODE)["spec"]["strategy"]["rollingUpdate"] == {
        "maxSurge": 0, "maxUnavailable": "25%"}


def test_pods_drain_and_spread_over_nodes_unless_told_otherwise():
    isvc = parse(isvc_body(decode={"terminationGracePeriodSeconds": 120,
                                   "topologySpreadConstraints": [{"maxSkew": 2, "topologyKey": "zone",
                                                                  "whenUnsatisfiable": "DoNotSchedule"}]},
                           prefill={"terminationGracePeriodSeconds": 8}, router={"topologySpreadConstraints": []}))
    prefill = engine_deployment(isvc, Role.PREFILL)["spec"]["template"]["spec"]
    assert prefill["topologySpreadConstraints"] == [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {"baton.dev/inference-service": "demo", "baton.dev/role": "prefill"}}}]
    # the preStop wait (while the pod leaves the endpoints) fits in the grace period, then SIGTERM drains
    assert prefill["containers"][0]["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "2"]}}}
    decode = engine_deployment(isvc, Role.DECODE)["spec"]["template"]["spec"]
    assert decode["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    assert decode["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert decode["terminationGracePeriodSeconds"] == 120
    router = router_deployment(isvc)["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in router
    # a router pod relays the longest generation an engine may finish, after its own preStop wait
    assert router["terminationGracePeriodSeconds"] == 5 + 120
    assert router["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]


def test_colocated_engine_has_no_disaggregation_flags():
    isvc = parse(isvc_body(mode="colocated", engine={"replicas": 2, "gpus": 1},
                           kvTransfer={"protocol": "rdma", "rdmaResourceName": "rdma/x"}))
    dep = engine_deployment(isvc, Role.COLOCATED)
    assert dep["metadata"]["name"] == "demo-engine"
    args = container(dep)["args"]
    assert not [a for a in args if a.startswith("--disaggregation")]
    assert container(dep)["resources"]["limits"] == {"nvidia.com/gpu": 1}
    kinds = [(o["kind"], o["metadata"]["name"]) for o in build_children(isvc)]
    assert ("Deployment", "demo-engine") in kinds and ("Deployment", "demo-prefill") not in kinds


@pytest.mark.parametrize("model, volume", [
    ({"pvc": {"claimName": "models", "subPath": "tiny"}}, {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}),
    ({"hostPath": {"path": "/data/tiny"}}, {"hostPath": {"path": "/data/tiny", "type": "Directory"}}),
    ({}, None),
])
def test_model_source_volumes(model, volume):
    isvc = parse(isvc_body(model={"name": "tiny", "path": "/models/tiny", **model}))
    pod = engine_deployment(isvc, Role.PREFILL)["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["name"]: m for m in pod["containers"][0].get("volumeMounts", [])}
    assert "dshm" not in vols and "dshm" not in mounts  # one rank: the runtime's /dev/shm is enough
    if volume is None:
        assert "model" not in vols and "model" not in mounts
    else:
        assert {k: v for k, v in vols["model"].items() if k != "name"} == volume
        assert mounts["model"]["mountPath"] == "/models/tiny" and mounts["model"]["readOnly"] is True
    if "pvc" in model:
        assert mounts["model"]["subPath"] == "tiny"


def test_colocated_tensor_parallel_engine_gets_tp_size_and_a_memory_dev_shm():
    isvc = parse(isvc_body(mode="colocated", engine={"tp": 2, "gpus": 2}))
    dep = engine_deployment(isvc, Role.COLOCATED)
    c, pod = container(dep), dep["spec"]["template"]["spec"]
    assert flag(c["args"], "--tp-size") == "2" and flag(c["args"], "--dp-size") == "1"
    assert flag(c["args"], "--device") == "cuda" and c["resources"]["limits"] == {"nvidia.com/gpu": 2}
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # shared memory needs no privilege


def test_pd_roles_with_tensor_parallelism_get_tp_size_and_a_memory_dev_shm():
    """Each TP rank of a prefill sends its KV shard to the same rank of the decode: both get --tp-size,
    the disaggregation flags, and /dev/shm for the ranks' collectives."""
    isvc = parse(isvc_body(prefill={"tp": 2}, decode={"tp": 2, "dp": 2}))
    for role, ranks in ((Role.PREFILL, 2), (Role.DECODE, 4)):
        dep = engine_deployment(isvc, role)
        c, pod = container(dep), dep["spec"]["template"]["spec"]
        assert flag(c["args"], "--tp-size") == "2" and flag(c["args"], "--disaggregation-mode") == role.value
        assert flag(c["args"], "--dp-size") == str(ranks // 2) and flag(c["args"], "--device") == "cpu"
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]


@pytest.mark.parametrize("role_spec, shm", [
    ({}, None), ({"gpus": 1}, None), ({"dp": 2}, {"medium": "Memory"}),
    ({"tp": 2, "dp": 2, "gpus": 4}, {"medium": "Memory"}),
    ({"tp": 2, "gpus": 2, "shmSize": "8Gi"}, {"medium": "Memory", "sizeLimit": "8Gi"}),
    ({"shmSize": "1Gi"}, {"medium": "Memory", "sizeLimit": "1Gi"}),  # asked for: one rank gets it too
], ids=["cpu-1-rank", "gpu-1-rank", "dp2", "tp2-dp2", "tp2-sized", "1-rank-sized"])
def test_dev_shm_volume_only_for_pods_of_several_ranks_or_a_set_shm_size(role_spec, shm):
    isvc = parse(isvc_body(mode="colocated", engine=role_spec))
    pod = engine_deployment(isvc, Role.COLOCATED)["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = pod["containers"][0].get("volumeMounts", [])
    if shm is None:
        assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]
    else:
        assert vols["dshm"]["emptyDir"] == shm
        assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts


def test_placement_env_and_resources_are_copied_to_the_role():
    placement = {"nodeSelector": {"gpu": "h100"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
                 "affinity": {"nodeAffinity": {}}, "env": [{"name": "X", "value": "1"}],
                 "resources": {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}}
    isvc = parse(isvc_body(decode=placement))
    pod = engine_deployment(isvc, Role.DECODE)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"] == placement["tolerations"]
    assert pod["affinity"] == {"nodeAffinity": {}}
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["X"]["value"] == "1" and env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "2"}, "limits": {"memory": "4Gi"}}
    assert "nodeSelector" not in engine_deployment(isvc, Role.PREFILL)["spec"]["template"]["spec"]


def test_router_pd_args_select_the_engine_roles():
    isvc = parse(isvc_body(namespace="team-a", router={"prefillPolicy": "random", "decodePolicy": "power_of_two"}))
    args = router_args(isvc)
    assert args[:4] == ["--host", "0.0.0.0", "--port", "8000"]
    assert "--pd-disaggregation" in args and "--service-discovery" in args
    i = args.index("--prefill-selector")
    assert args[i + 1:i + 3] == ["baton.dev/inference-service=demo", "baton.dev/role=prefill"]
    i = args.index("--decode-selector")
    assert args[i + 1:i + 3] == ["baton.dev/inference-service=demo", "baton.dev/role=decode"]
    assert flag(args, "--service-discovery-namespace") == "team-a"
    assert flag(args, "--service-discovery-port") == "30000"
    assert flag(args, "--prefill-policy") == "random" and flag(args, "--decode-policy") == "power_of_two"
    assert flag(args, "--shutdown-timeout-secs") == "60"  # the engines' default grace period


def test_router_lets_relays_run_as_long_as_the_slowest_engine_role_may():
    isvc = parse(isvc_body(decode={"terminationGracePeriodSeconds": 300}))
    assert flag(router_args(isvc), "--shutdown-timeout-secs") == "300"
    grace = router_deployment(isvc)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > 300, "the router's pod outlives the relays: preStop sleep + the longest engine grace"


def test_router_colocated_args():
    args = router_args(parse(isvc_body(mode="colocated", router={"policy": "round_robin"})))
    assert "--pd-disaggregation" not in args and "--prefill-selector" not in args
    i = args.index("--selector")
    assert args[i + 1:i + 3] == ["baton.dev/inference-service=demo", "baton.dev/role=colocated"]
    assert flag(args, "--policy") == "round_robin"


def test_router_api_key_comes_from_the_secret_never_an_argument():
    isvc = parse(isvc_body(router={"apiKeySecretRef": {"name": "keys"}}))
    c = container(router_deployment(isvc))
    assert c["env"][0] == {"name": "BATON_API_KEY",
                           "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}}}
    assert not [a for a in c["args"] if "api-key" in a]
    assert c["command"] == ["baton", "router"]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_engines_and_router_share_the_internal_key_from_its_secret_never_an_argument(mode):
    """The engines take it as their API key (BATON_API_KEY), the router sends it to them
    (BATON_ENGINE_API_KEY); the clients' key (apiKeySecretRef) stays the router's own."""
    isvc = parse(isvc_body(mode=mode, router={"apiKeySecretRef": {"name": "keys"}}))
    ref = {"secretKeyRef": {"name": "demo-internal-key-uid-demo", "key": "api-key"}}
    for role in isvc.spec.roles:
        env = container(engine_deployment(isvc, role))["env"]
        assert {"name": "BATON_API_KEY", "valueFrom": ref} in env, role
        assert [e["name"] for e in env].count("BATON_API_KEY") == 1
    router = container(router_deployment(isvc))
    assert router["env"][:2] == [
        {"name": "BATON_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}}},
        {"name": "BATON_ENGINE_API_KEY", "valueFrom": ref}]
    for c in [router, *(container(engine_deployment(isvc, r)) for r in isvc.spec.roles)]:
        assert not [a for a in c["args"] if "key" in a]


ENGINE_PODS = {"matchLabels": {"baton.dev/inference-service": "demo"},
               "matchExpressions": [{"key": "baton.dev/role", "operator": "In",
                                     "values": ["prefill", "decode", "colocated"]}]}
ENGINE_PORT = [{"protocol": "TCP", "port": 30000}]


def network_policy(operator_ns: str | None = None, **spec) -> dict | None:
    children = build_children(parse(isvc_body(**spec)), operator_namespace=operator_ns)
    return next((o for o in children if o["kind"] == "NetworkPolicy"), None)


def test_engine_pods_take_ingress_only_from_the_services_router_and_engines():
    pol = network_policy()
    assert pol["metadata"]["name"] == "demo-engines" and pol["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert pol["spec"]["podSelector"] == ENGINE_PODS and pol["spec"]["policyTypes"] == ["Ingress"]
    assert pol["spec"]["ingress"] == [
        # the router, on the engine port only (the pods the router Service selects are not in the policy)
        {"from": [{"podSelector": {"matchLabels": {"baton.dev/inference-service": "demo", "baton.dev/role": "router"}}}],
         "ports": ENGINE_PORT},
        # the service's engines, on every port: bootstrap, KV side channel and Mooncake pick theirs at random
        {"from": [{"podSelector": ENGINE_PODS}]}]
    assert network_policy(mode="colocated")["spec"] == pol["spec"]  # a mode switch keeps the old roles in


def test_scrapers_reach_the_engine_port_only_the_planner_from_the_operators_namespace():
    prometheus = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "baton-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "baton-operator"}}}
    planner = {"mode": "planner", "decode": {"targetKVUsage": 0.7}}
    assert network_policy(monitoring={"podMonitor": True})["spec"]["ingress"][2] == {
        "from": [prometheus], "ports": ENGINE_PORT}
    assert network_policy(autoscaling=planner, operator_ns="baton-system")["spec"]["ingress"][2] == {
        "from": [operator], "ports": ENGINE_PORT}
    assert len(network_policy(autoscaling=planner)["spec"]["ingress"]) == 2  # an operator outside the cluster
    assert len(network_policy(operator_ns="baton-system")["spec"]["ingress"]) == 2  # no planner: no scrapes
    mine = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert network_policy(networkPolicy={"metricsFrom": mine})["spec"]["ingress"][2]["from"] == mine
    assert len(network_policy(monitoring={"serviceMonitor": True}, networkPolicy={"metricsFrom": []})
               ["spec"]["ingress"]) == 2


def test_network_policy_opt_out():
    assert network_policy(networkPolicy={"enabled": False}) is None


def test_router_service_account_may_only_read_pods_in_its_namespace():
    isvc = parse(isvc_body(namespace="team-a"))
    role = router_role(isvc)
    assert role["kind"] == "Role" and role["metadata"]["namespace"] == "team-a"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = router_role_binding(isvc)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo-router"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-router", "namespace": "team-a"}]
    pod = router_deployment(isvc)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "demo-router"


def test_router_service_type_and_port():
    svc = router_service(parse(isvc_body(router={"service": {"type": "LoadBalancer", "port": 80}})))
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]


def test_monitors_only_when_asked():
    isvc = parse(isvc_body())
    assert {o["kind"] for o in build_children(isvc)}.isdisjoint({"PodMonitor", "ServiceMonitor"})
    isvc = parse(isvc_body(monitoring={"podMonitor": True, "serviceMonitor": True, "labels": {"release": "prom"}}))
    kinds = {o["kind"] for o in build_children(isvc)}
    assert {"PodMonitor", "ServiceMonitor"} <= kinds
    pm, sm = pod_monitor(isvc), service_monitor(isvc)
    assert pm["spec"]["selector"]["matchLabels"] == {naming.SERVICE_LABEL: "demo"}
    relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_baton_dev_inference_service"],
               "targetLabel": "inference_service", "action": "replace"}
    assert pm["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s",
                                                  "relabelings": [relabel]}]
    assert sm["metadata"]["labels"]["release"] == "prom"


def test_every_child_is_owned_and_stamped_with_a_hash_that_tracks_its_own_spec():
    before = {o["metadata"]["name"] + o["kind"]: o for o in build_children(parse(isvc_body()))}
    for obj in before.values():
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
        assert len(obj["metadata"]["annotations"][naming.SPEC_HASH_ANNOTATION]) == 16
    after = {o["metadata"]["name"] + o["kind"]: o for o in build_children(parse(isvc_body(decode={"replicas": 4})))}
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {"demo-decodeDeployment", "demo-topologyConfigMap"}


def test_engine_args_follow_the_cli_contract_for_colocated():
    isvc = parse(isvc_body(mode="colocated"))
    assert engine_args(isvc, Role.COLOCATED) == [
        "--model-path", "/models/tiny", "--host", "0.0.0.0", "--port", "30000", "--served-model-name", "tiny",
        "--device", "cpu", "--tp-size", "1", "--dp-size", "1"]


def test_one_disruption_budget_per_role_with_a_default_the_spec_overrides():
    pdbs = {o["metadata"]["name"]: o for o in build_children(parse(isvc_body(decode={"disruptionBudget": {
        "maxUnavailable": "25%"}}))) if o["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {"demo-prefill", "demo-decode", "demo-router"}
    for role in (Role.PREFILL, Role.DECODE, Role.ROUTER):
        pdb = pdbs[naming.child_name("demo", role)]
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"]["selector"] == {"matchLabels": naming.selector_labels("demo", role)}
        assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a pod that is not Ready never blocks a drain
        assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert pdbs["demo-prefill"]["spec"]["maxUnavailable"] == 1 and pdbs["demo-router"]["spec"]["maxUnavailable"] == 1
    assert pdbs["demo-decode"]["spec"]["maxUnavailable"] == "25%"
    colocated = build_children(parse(isvc_body(mode="colocated", router={"disruptionBudget": {"maxUnavailable": 0}})))
    budgets = {o["metadata"]["name"]: o["spec"]["maxUnavailable"] for o in colocated if o["kind"] == "PodDisruptionBudget"}
    assert budgets == {"demo-engine": 1, "demo-router": 0}


def test_planned_roles_are_created_within_their_bounds_and_keep_what_the_planner_sets():
    isvc = parse(isvc_body(decode={"replicas": 9}, prefill={"replicas": 2}, autoscaling={
        "mode": "planner", "decode": {"minReplicas": 2, "maxReplicas": 4, "targetKVUsage": 0.7}}))
    decode, prefill = engine_deployment(isvc, Role.DECODE), engine_deployment(isvc, Role.PREFILL)
    assert decode["spec"]["replicas"] == 4 and decode["metadata"]["annotations"] == {"baton.dev/replicas": "planner"}
    assert prefill["spec"]["replicas"] == 2 and "annotations" not in prefill["metadata"]  # not planned: the spec's
    live = {**decode, "spec": {**decode["spec"], "replicas": 3}}  # what the planner set
    assert keep_live_replicas(live, decode)["spec"]["replicas"] == 3 and spec_hash(live) == spec_hash(decode)
