"""The service's internal key: a Secret the engines take as their API key and the router sends them.

Without it any pod of the cluster could reach the engines' generation and admin routes (`/drain`,
`/flush_cache`, `/abort_request`, `/get_server_info`); `/health` and `/metrics` stay open for probes and
scrapers. The key is drawn by the reconciler when it creates the Secret, once; this module only shapes it.
"""
from __future__ import annotations

from typing import Any

from baton.operator import naming
from baton.operator.builders.common import metadata
from baton.operator.spec import InferenceService

ENGINE_KEY_ENV = "BATON_API_KEY"  # `baton serve` reads its --api-key from it
ROUTER_KEY_ENV = "BATON_ENGINE_API_KEY"  # `baton router` reads its --engine-api-key from it


def internal_key_secret(isvc: InferenceService, key: str) -> dict[str, Any]:
    """Immutable: nobody rewrites a key the running pods hold (a new one needs a new Secret and new pods)."""
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": metadata(isvc, naming.internal_key_secret(isvc.name, isvc.uid)),
            "type": "Opaque", "immutable": True, "stringData": {naming.INTERNAL_KEY_FIELD: key}}


def internal_key_env(isvc: InferenceService, name: str) -> dict[str, Any]:
    """The key as an env var of a pod, from the Secret (never in the pod spec or an argument)."""
    ref = {"name": naming.internal_key_secret(isvc.name, isvc.uid), "key": naming.INTERNAL_KEY_FIELD}
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}
