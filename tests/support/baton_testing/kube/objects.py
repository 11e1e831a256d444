"""Small InferenceService bodies for tests, and the version a test compares to notice a write."""
from __future__ import annotations

import copy
from typing import Any

from baton.operator import naming


def isvc_body(name: str = "demo", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    """A minimal valid InferenceService; keyword arguments override spec keys.

    It carries a uid and generation like one read back from the API server, so builders can use it
    directly; the API server (real or emulated) replaces both on create.
    """
    base = {"image": "ghcr.io/baton-llm/baton:test", "model": {"name": "tiny", "path": "/models/tiny"}}
    base.update(copy.deepcopy(spec))
    return {"apiVersion": naming.API_VERSION, "kind": naming.KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1},
            "spec": base}


def for_create(body: dict[str, Any]) -> dict[str, Any]:
    """The body without server-set metadata, as a user would apply it."""
    body = copy.deepcopy(body)
    for key in ("uid", "generation", "resourceVersion", "creationTimestamp"):
        body["metadata"].pop(key, None)
    return body


def written_version(obj: dict[str, Any]) -> str:
    """What changes when someone writes an object's spec or data: `metadata.generation` where the API
    server keeps one (a real Deployment controller writing `.status` does not bump it), else the
    resourceVersion."""
    meta = obj["metadata"]
    return f"g{meta['generation']}" if "generation" in meta else f"rv{meta['resourceVersion']}"
