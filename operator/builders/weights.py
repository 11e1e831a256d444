"""spec.model.updateStrategy InPlace: a new source reaches the running engines as a weight update.

Two objects, both shaped here and driven by the reconciler:

- the model ConfigMap (`<name>-model`): the version the engines serve (source, its folder in the cache,
  its weight version). The engine pods read it as env when they start: the init container fetches
  `$(BATON_MODEL_SOURCE)`, the engine loads `--model-path $(BATON_MODEL_PATH)` as `--weight-version
  $(BATON_WEIGHT_VERSION)`. The pod template never names a source, so a new one changes no template and
  restarts no pod, and a pod started after an update loads the version the others serve. The
  reconciler writes the ConfigMap only once that version is in use.
- the weights Job (`<name>-weights-<hash>`): the `fetch-model` init container fills the shared cache
  with the new source, then `python -m baton.operator.weights_job` asks the router to update every engine
  from disk (`/update_weights_from_disk`). The router's API key reaches that container alone, from the
  Secret the spec names (the operator itself reads no Secret).
"""
from __future__ import annotations

import copy
import posixpath
from typing import Any

from baton.fetch.source import ModelSource
from baton.operator import naming
from baton.operator.builders.common import container_security_context, metadata, pod_security_context
from baton.operator.builders.model_cache import cache_volume, fetch_container
from baton.operator.spec import InferenceService

SOURCE_KEY, PATH_KEY, VERSION_KEY = "source", "modelPath", "weightVersion"
SOURCE_ENV, PATH_ENV, VERSION_ENV = "BATON_MODEL_SOURCE", "BATON_MODEL_PATH", "BATON_WEIGHT_VERSION"
UPDATE_CONTAINER = "update-weights"
SOURCE_ANNOTATION = f"{naming.GROUP}/model-source"  # on the Job: the source it fetches
UPDATE_ROUTE = "/update_weights_from_disk"
ROUTER_KEY_ENV = "BATON_ROUTER_API_KEY"  # the weights Job's key for the router (router.apiKeySecretRef)
JOB_BACKOFF_LIMIT = 1  # one retry: the fetch resumes, the router's update is all or nothing per try
JOB_TTL_SECONDS = 86400  # a finished Job (and its logs) stays a day; the ConfigMap keeps the outcome
UPDATE_RESOURCES = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}}


def model_path(source: ModelSource) -> str:
    """The source's folder in the cache, as the engines (and the Job) mount it."""
    return posixpath.join(naming.MODEL_CACHE_MOUNT, source.cache_key)


def version_data(source: ModelSource) -> dict[str, str]:
    """What the model ConfigMap holds for a source; the weight version is the source URI (a commit or a
    revision in it names the weights)."""
    return {SOURCE_KEY: source.uri, PATH_KEY: model_path(source), VERSION_KEY: source.uri}


def model_config_map(isvc: InferenceService, source: ModelSource) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(isvc, naming.model_config(isvc.name)), "data": version_data(source)}


def _config_env(isvc: InferenceService, env: str, key: str) -> dict[str, Any]:
    ref = {"name": naming.model_config(isvc.name), "key": key}
    return {"name": env, "valueFrom": {"configMapKeyRef": ref}}


def engine_version_env(isvc: InferenceService) -> list[dict[str, Any]]:
    """The engine container's env of the served version (its args name $(BATON_MODEL_PATH) and
    $(BATON_WEIGHT_VERSION))."""
    return [_config_env(isvc, PATH_ENV, PATH_KEY), _config_env(isvc, VERSION_ENV, VERSION_KEY)]


def in_place_fetch(isvc: InferenceService, container: dict[str, Any]) -> dict[str, Any]:
    """The engine pods' init container fetches the served source from the ConfigMap, not the spec's."""
    out = copy.deepcopy(container)
    args = out["args"]
    args[args.index("--source") + 1] = f"$({SOURCE_ENV})"
    out["env"] = [_config_env(isvc, SOURCE_ENV, SOURCE_KEY), *out["env"]]
    return out


def update_url(isvc: InferenceService) -> str:
    """The router Service, in the cluster: the router fans the update out to every engine."""
    host = naming.router_service_host(isvc.name, isvc.namespace)  # as builders.topology.endpoint_url
    return f"http://{host}:{isvc.spec.router.service_port}{UPDATE_ROUTE}"


def _update_container(isvc: InferenceService, source: ModelSource) -> dict[str, Any]:
    spec = isvc.spec
    env = []
    if spec.router.api_key is not None:
        ref = {"name": spec.router.api_key.name, "key": spec.router.api_key.key}
        env.append({"name": ROUTER_KEY_ENV, "valueFrom": {"secretKeyRef": ref}})
    return {"name": UPDATE_CONTAINER, "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
            "command": ["python", "-m", "baton.operator.weights_job"],
            "args": ["--url", update_url(isvc), "--model-path", model_path(source),
                     "--weight-version", source.uri],
            "env": env, "resources": copy.deepcopy(UPDATE_RESOURCES),
            "securityContext": container_security_context(read_only_root=True),
            "terminationMessagePolicy": "FallbackToLogsOnError"}


def weights_job(isvc: InferenceService) -> dict[str, Any]:
    """Fetch spec.model.source into the shared cache (the same init container as the engine pods, the
    cache read-write), then update the engines to it through the router."""
    spec = isvc.spec
    source = spec.model.source
    assert spec.model.in_place and source is not None and spec.model.cache_claim
    role = next(iter(spec.roles.values()))  # its env (proxies, CA bundles) reaches the fetch, as in the pods
    pod: dict[str, Any] = {
        "restartPolicy": "Never", "automountServiceAccountToken": False, "enableServiceLinks": False,
        "securityContext": pod_security_context(spec.pod_security),
        "initContainers": [fetch_container(isvc, role)],
        "containers": [_update_container(isvc, source)],
        "volumes": [cache_volume(isvc)],
    }
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": n} for n in spec.image_pull_secrets]
    meta = metadata(isvc, naming.weights_job(isvc.name, source.uri), annotations={SOURCE_ANNOTATION: source.uri})
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": JOB_BACKOFF_LIMIT, "ttlSecondsAfterFinished": JOB_TTL_SECONDS,
                     "template": {"metadata": {"labels": dict(meta["labels"])}, "spec": pod}}}
