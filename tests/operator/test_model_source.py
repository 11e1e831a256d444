"""spec.model.source in the operator: what each source becomes in the engine pods (the model path, the
volumes, the `baton fetch-model` init container and who sees the credentials), and the ModelReady condition
read from the init containers' states."""
from __future__ import annotations

import pytest

from baton.operator import naming
from baton.operator.builders.engine import engine_deployment
from baton.operator.builders.router import router_deployment
from baton.operator.naming import Role
from baton.operator.spec import InvalidSpec, parse
from baton.operator.status import compute_status
from baton_testing.kube.objects import isvc_body

NOW = "2026-01-01T00:00:00Z"
HF = {"name": "qwen", "source": "hf://Qwen/Qwen3-0.6B@c0ffee", "cache": {"claimName": "model-cache"},
      "fetch": {"secretName": "hf-token", "endpoint": "http://hub-mirror.ml:8080", "include": ["*.json", "*.safetensors"]}}


def pod_spec(body: dict, role: Role = Role.PREFILL) -> dict:
    return engine_deployment(parse(body), role)["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
def test_hf_source_is_fetched_by_an_init_container_and_the_engine_starts_from_the_cache(role):
    pod = pod_spec(isvc_body(model=HF), role)
    [init] = pod["initContainers"]
    engine = pod["containers"][0]
    assert init["name"] == naming.FETCH_CONTAINER and init["image"] == engine["image"]
    assert init["command"] == ["baton", "fetch-model"]
    assert init["args"] == ["--source", "hf://Qwen/Qwen3-0.6B@c0ffee", "--cache-dir", "/model-cache",
                            "--include", "*.json", "--include", "*.safetensors"]
    assert flag(engine["args"], "--model-path") == "/model-cache/hf/Qwen/Qwen3-0.6B/c0ffee"
    assert {v["name"]: v for v in pod["volumes"]}["model-cache"]["persistentVolumeClaim"] == {"claimName": "model-cache"}
    assert init["volumeMounts"] == [{"name": "model-cache", "mountPath": "/model-cache"}]
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "HF_ENDPOINT", "value": "http://hub-mirror.ml:8080"} in init["env"]
    # the token: only the init container reads the Secret, and nothing carries its value
    assert init["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert "envFrom" not in engine and "hf-token" not in str(engine)
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_router_never_sees_the_fetch_secret():
    dep = router_deployment(parse(isvc_body(model=HF)))
    assert "hf-token" not in str(dep) and "initContainers" not in dep["spec"]["template"]["spec"]


def test_s3_source_with_an_emptydir_cache_and_its_endpoint():
    model = {"name": "m", "source": "s3://models/qwen3/", "cache": {"emptyDir": {"sizeLimit": "20Gi"}},
             "fetch": {"endpoint": "http://minio.storage:9000", "region": "eu-west-1", "secretName": "s3-creds"}}
    pod = pod_spec(isvc_body(mode="colocated", model=model), Role.COLOCATED)
    [init] = pod["initContainers"]
    assert {v["name"]: v for v in pod["volumes"]}["model-cache"]["emptyDir"] == {"sizeLimit": "20Gi"}
    assert {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"} in init["env"]
    assert {"name": "AWS_REGION", "value": "eu-west-1"} in init["env"]
    assert flag(pod["containers"][0]["args"], "--model-path") == "/model-cache/s3/models/qwen3"


def test_pvc_and_image_sources_mount_or_name_the_path_without_a_fetch():
    pod = pod_spec(isvc_body(model={"name": "m", "source": "pvc://models/qwen/v1"}))
    assert "initContainers" not in pod
    assert {v["name"]: v for v in pod["volumes"]}["model"]["persistentVolumeClaim"] == {"claimName": "models",
                                                                                       "readOnly": True}
    mount = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}["model"]
    assert (mount["mountPath"], mount["subPath"], mount["readOnly"]) == (naming.PVC_MODEL_MOUNT, "qwen/v1", True)
    assert flag(pod["containers"][0]["args"], "--model-path") == naming.PVC_MODEL_MOUNT

    mounted_at = pod_spec(isvc_body(model={"name": "m", "source": "pvc://models", "path": "/weights"}))
    assert flag(mounted_at["containers"][0]["args"], "--model-path") == "/weights"
    assert "subPath" not in mounted_at["containers"][0]["volumeMounts"][0]

    image = pod_spec(isvc_body(model={"name": "m", "source": "/opt/models/qwen"}))
    assert "initContainers" not in image and "volumes" not in image
    assert flag(image["containers"][0]["args"], "--model-path") == "/opt/models/qwen"


def test_a_spec_without_source_is_unchanged():
    pod = pod_spec(isvc_body())
    assert "initContainers" not in pod and flag(pod["containers"][0]["args"], "--model-path") == "/models/tiny"


@pytest.mark.parametrize("model, words", [
    ({"name": "m", "source": "hf://only-a-name", "cache": {"claimName": "c"}}, "spec.model.source must be hf://org/name"),
    ({"name": "m", "source": "ftp://host/x"}, "spec.model.source must be"),
    ({"name": "m", "source": "s3://bucket/x"}, "is fetched into spec.model.cache"),
    ({"name": "m", "source": "hf://a/b", "path": "/m", "cache": {"claimName": "c"}}, "remove spec.model.path"),
    ({"name": "m"}, "set spec.model.source"),
])
def test_bad_sources_are_refused_saying_what_to_write(model, words):
    with pytest.raises(InvalidSpec) as info:
        parse(isvc_body(model=model))
    assert any(words in e for e in info.value.errors), info.value.errors


def deployment(replicas: int, ready: int) -> dict:
    return {"metadata": {"generation": 1}, "spec": {"replicas": replicas},
            "status": {"observedGeneration": 1, "replicas": replicas, "readyReplicas": ready,
                       "updatedReplicas": replicas, "availableReplicas": ready}}


def pod(role: Role, name: str, state: dict, last: dict | None = None) -> dict:
    status = {"name": naming.FETCH_CONTAINER, "ready": False, "restartCount": 1 if last else 0, "state": state}
    if last:
        status["lastState"] = {"terminated": last}
    return {"metadata": {"name": name, "labels": naming.selector_labels("demo", role)},
            "status": {"phase": "Pending", "initContainerStatuses": [status]}}


def model_ready(pods: list[dict]) -> tuple[dict, dict]:
    isvc = parse(isvc_body(model=HF))
    deps = {Role.PREFILL: deployment(1, 0), Role.DECODE: deployment(1, 0), Role.ROUTER: deployment(1, 1)}
    c = {c["type"]: c for c in compute_status(isvc, deps, {}, NOW, 1, pods=pods)["conditions"]}
    return c["ModelReady"], c["Degraded"]


RUNNING = {"running": {"startedAt": NOW}}
DONE = {"terminated": {"exitCode": 0, "reason": "Completed"}}
DENIED = {"exitCode": 1, "reason": "Error", "message": "hf://Qwen/Qwen3-0.6B@c0ffee at http://hub-mirror.ml:8080: "
          "access denied (HTTP 401): the repository is private or gated and no token was given"}


def test_model_ready_follows_the_init_containers():
    pending, _ = model_ready([])
    assert (pending["status"], pending["reason"]) == ("False", "Pending")

    fetching, degraded = model_ready([pod(Role.PREFILL, "demo-prefill-a", RUNNING),
                                      pod(Role.DECODE, "demo-decode-a", {"waiting": {"reason": "PodInitializing"}})])
    assert (fetching["status"], fetching["reason"]) == ("False", "Fetching")
    assert "1 pod(s) fetching hf://Qwen/Qwen3-0.6B@c0ffee into the cache (PVC model-cache)" in fetching["message"]
    assert "logs demo-prefill-a -c fetch-model" in fetching["message"]
    assert degraded["status"] == "False"

    failed, degraded = model_ready([pod(Role.PREFILL, "demo-prefill-a", {"waiting": {"reason": "CrashLoopBackOff"}}, DENIED),
                                    pod(Role.DECODE, "demo-decode-a", RUNNING)])
    assert (failed["status"], failed["reason"]) == ("False", "FetchFailed")
    assert DENIED["message"] in failed["message"] and "demo-prefill-a" in failed["message"]
    assert (degraded["status"], degraded["reason"]) == ("True", "FetchFailed")

    retrying, _ = model_ready([pod(Role.PREFILL, "demo-prefill-a", RUNNING, DENIED)])
    assert retrying["reason"] == "Fetching" and "the last try failed" in retrying["message"]

    ready, degraded = model_ready([pod(Role.PREFILL, "demo-prefill-a", DONE), pod(Role.DECODE, "demo-decode-a", DONE)])
    assert (ready["status"], ready["reason"]) == ("True", "Fetched")
    assert "/model-cache/hf/Qwen/Qwen3-0.6B/c0ffee" in ready["message"] and degraded["status"] == "False"


def test_no_model_ready_condition_without_a_fetched_source():
    isvc = parse(isvc_body())
    deps = {Role.PREFILL: deployment(1, 1), Role.DECODE: deployment(1, 1), Role.ROUTER: deployment(1, 1)}
    assert "ModelReady" not in {c["type"] for c in compute_status(isvc, deps, {}, NOW, 1)["conditions"]}
