"""The model cache of an hf:// or s3:// source: its volume (a PVC the service's pods share, or an emptyDir
per pod) and the `baton fetch-model` init container that fills it before the engine starts."""
from __future__ import annotations

import copy
from typing import Any

from baton.fetch.source import Scheme
from baton.operator import naming
from baton.operator.builders.common import container_security_context
from baton.operator.spec import InferenceService, RoleSpec

CACHE_VOLUME = "model-cache"
# The fetch streams to disk: little CPU and memory, whatever the model's size.
FETCH_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def cache_volume(isvc: InferenceService) -> dict[str, Any]:
    m = isvc.spec.model
    assert m.fetched, "only fetched sources have a cache"
    if m.cache_claim:
        return {"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": m.cache_claim}}
    return {"name": CACHE_VOLUME, "emptyDir": {"sizeLimit": m.cache_size_limit} if m.cache_size_limit else {}}


def engine_cache_mount() -> dict[str, Any]:
    """The engine reads the cache, never writes it."""
    return {"name": CACHE_VOLUME, "mountPath": naming.MODEL_CACHE_MOUNT, "readOnly": True}


def _env(isvc: InferenceService, r: RoleSpec) -> list[dict[str, Any]]:
    m = isvc.spec.model
    assert m.source is not None
    env = []
    if m.fetch_endpoint:
        name = "HF_ENDPOINT" if m.source.scheme is Scheme.HF else "AWS_ENDPOINT_URL"
        env.append({"name": name, "value": m.fetch_endpoint})
    if m.fetch_region and m.source.scheme is Scheme.S3:
        env.append({"name": "AWS_REGION", "value": m.fetch_region})
    return env + copy.deepcopy(r.env)  # the role's own env too: proxies, CA bundles


def fetch_container(isvc: InferenceService, r: RoleSpec) -> dict[str, Any]:
    """`baton fetch-model` into the cache; a folder already complete for this source is skipped at once.
    Credentials come only from the Secret spec.model.fetch.secretName, as env of this container alone."""
    m, spec = isvc.spec.model, isvc.spec
    assert m.source is not None and m.fetched
    args = ["--source", m.source.uri, "--cache-dir", naming.MODEL_CACHE_MOUNT]
    for pattern in m.fetch_include:
        args += ["--include", pattern]
    container: dict[str, Any] = {
        "name": naming.FETCH_CONTAINER, "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
        "command": ["baton", "fetch-model"], "args": args, "env": _env(isvc, r),
        "resources": copy.deepcopy(FETCH_RESOURCES),
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": naming.MODEL_CACHE_MOUNT}],
        "securityContext": container_security_context(read_only_root=True),
        # the failure reason (`baton fetch-model` writes it there) reaches the ModelReady condition
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if m.fetch_secret:
        container["envFrom"] = [{"secretRef": {"name": m.fetch_secret}}]
    return container
