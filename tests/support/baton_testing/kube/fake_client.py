"""An in-memory stand-in for `baton.operator.kube.KubeClient`, for handler and reconciler tests that
need to script one API answer (a refused create, a foreign object) without a server."""
from __future__ import annotations

import copy
import itertools
import logging
from collections.abc import Callable
from typing import Any

import kopf

from baton.operator.config import OperatorConfig
from baton.operator.kube import ApiError, Kind, kind_of
from baton.operator.metrics import OperatorMetrics

Key = tuple[str, str | None, str]  # (kind, namespace, name)


def merged(live: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(live) if isinstance(live, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merged(out.get(k), v)
    return out


class FakeClient:
    """Objects by (kind, namespace, name). `refuse(obj)` may return an ApiError a create or patch gets."""

    def __init__(self, refuse: Callable[[dict[str, Any]], ApiError | None] = lambda obj: None):
        self.objects: dict[Key, dict[str, Any]] = {}
        self.refuse = refuse
        self.deleted: list[Key] = []
        self._uids = itertools.count(1)

    def put(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        obj["metadata"].setdefault("uid", f"fake-{next(self._uids)}")
        self.objects[(obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])] = obj
        return obj

    def find(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, namespace, name)))

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.find(kind.kind, namespace, name)

    async def list(self, kind: Kind, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if (k, ns) == (kind.kind, namespace)
                and labels.items() <= (o["metadata"].get("labels") or {}).items()]

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind_of(obj)
        key = (obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in self.objects:
            raise ApiError(409, "AlreadyExists", f"{key} already exists")
        if (error := self.refuse(obj)) is not None:
            raise error
        return copy.deepcopy(self.put(obj))

    async def patch(self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any],
                    sub: str | None = None) -> dict[str, Any]:
        key = (kind.kind, namespace, name)
        if key not in self.objects:
            raise ApiError(404, "NotFound", f"{key} not found")
        if sub == "status":
            patch = {"status": patch.get("status")}
        after = merged(self.objects[key], patch)
        if sub is None and (error := self.refuse(after)) is not None:
            raise error
        self.objects[key] = after
        return copy.deepcopy(after)

    async def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        key = (kind.kind, namespace, name)
        if self.objects.pop(key, None) is not None:
            self.deleted.append(key)

    async def close(self) -> None:
        pass


def memo_for(client: FakeClient) -> kopf.Memo:
    """What the operator's startup handler puts in kopf's memo, around `client`."""
    return kopf.Memo(client=client, metrics=OperatorMetrics(), locks={},
                     config=OperatorConfig(resync_seconds=30, retry_seconds=0.5, metrics_port=None))


LOGGER = logging.getLogger("baton.operator.test")
