"""spec.model.source on the real control plane: an hf:// source with a shared PVC cache becomes, in every
engine pod the ReplicaSets create, a `baton fetch-model` init container writing the claim and an engine
reading the source's folder in it; the scheduler places the pods with the bound claim; ModelReady follows the
init containers' states (kwok completes them, as it runs no container); a bad source is refused by the API
server with the CRD's message."""
from __future__ import annotations

import yaml
from e2e_support import (conditions, create_namespace, get_json, get_or_none, isvc_condition, sample, wait_for)

from baton_testing.kube.controlplane import ControlPlane

NS = "e2e-model-source"
NAME = "smollm2"
SOURCE = "hf://HuggingFaceTB/SmolLM2-135M-Instruct@main"
CACHED = "/model-cache/hf/HuggingFaceTB/SmolLM2-135M-Instruct/main"


def cache_claim(ns: str) -> list[dict]:
    """A ReadWriteMany claim bound to a pre-made volume (the control plane has no provisioner)."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{ns}-cache"},
          "spec": {"capacity": {"storage": "10Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": "manual",
                   "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": "/srv/model-cache"},
                   "claimRef": {"namespace": ns, "name": "model-cache"}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "model-cache", "namespace": ns},
           "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "manual", "volumeName": f"{ns}-cache",
                    "resources": {"requests": {"storage": "10Gi"}}}}
    return [pv, pvc]


def arg(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_an_hf_source_is_fetched_by_an_init_container_into_the_shared_cache(control_plane: ControlPlane, operator):
    ns = create_namespace(control_plane, NS)
    control_plane.apply(cache_claim(ns))
    control_plane.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": ns},
                          "stringData": {"HF_TOKEN": "hf_not_a_real_token"}}])
    wait_for(lambda: get_json(control_plane, "pvc", "model-cache", "-n", ns)["status"].get("phase") == "Bound",
             "the cache claim bound")
    model = {"name": NAME, "source": SOURCE, "cache": {"claimName": "model-cache"},
             "fetch": {"secretName": "hf-token", "include": ["*.json", "*.safetensors"]}}
    control_plane.apply([sample("cpu-smollm2.yaml", ns, model=model)])

    ready = isvc_condition(control_plane, ns, NAME, "ModelReady", "True", timeout=120)
    assert conditions(ready)["ModelReady"]["reason"] == "Fetched"
    assert CACHED in conditions(ready)["ModelReady"]["message"]
    isvc_condition(control_plane, ns, NAME, "Ready", "True", timeout=120)

    pods = get_json(control_plane, "pods", "-n", ns, "-l", f"baton.dev/inference-service={NAME}")["items"]
    engines = [p for p in pods if p["metadata"]["labels"]["baton.dev/role"] in ("prefill", "decode")]
    assert len(engines) == 2
    for pod in engines:  # made by the real ReplicaSet controller and placed by the real scheduler
        spec = pod["spec"]
        [init] = spec["initContainers"]
        assert init["name"] == "fetch-model" and init["command"] == ["baton", "fetch-model"]
        assert arg(init["args"], "--source") == SOURCE and arg(init["args"], "--cache-dir") == "/model-cache"
        assert init["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
        [engine] = spec["containers"]
        assert arg(engine["args"], "--model-path") == CACHED and "envFrom" not in engine
        assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in engine["volumeMounts"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] == "model-cache"
        assert spec.get("nodeName"), "scheduled with the bound claim"
        [status] = pod["status"]["initContainerStatuses"]
        assert status["state"]["terminated"]["exitCode"] == 0
    router = [p for p in pods if p["metadata"]["labels"]["baton.dev/role"] == "router"]
    assert router and "hf-token" not in yaml.safe_dump(router)


def test_a_bad_source_is_refused_by_the_api_server(control_plane: ControlPlane, operator):
    ns = create_namespace(control_plane, NS)
    bad = sample("cpu-smollm2.yaml", ns, model={"name": NAME, "source": "hf://no-org", "cache": {"emptyDir": {}}})
    bad["metadata"]["name"] = "bad-source"
    result = control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert result.returncode == 1 and "spec.model.source must be hf://org/name[@revision]" in result.stderr
    assert get_or_none(control_plane, "inferenceservice", "bad-source", "-n", ns) is None
