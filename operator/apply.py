"""Create-or-patch of one desired child, by spec hash; and the JSON merge patch it sends.

A child is patched only when its spec-hash annotation differs from the desired one, so a reconcile of an
unchanged spec writes nothing (restarts are no-ops) and a change touches exactly the children whose
desired object changed. The patch makes the child's owned fields equal to the desired object: keys the
desired object drops are removed; labels/annotations added by others are kept.
"""
from __future__ import annotations

import copy
import enum
from typing import Any

from baton.operator import naming
from baton.operator.kube import KINDS, ApiError, KubeClient, kind_of

_SAME = object()
_METADATA_MAPS = ("labels", "annotations")


class Outcome(str, enum.Enum):
    CREATED = "created"
    PATCHED = "patched"
    UNCHANGED = "unchanged"


class NotOwned(Exception):
    """A child's name is taken by an object this InferenceService does not control."""


def _diff(live: Any, desired: Any) -> Any:
    if isinstance(live, dict) and isinstance(desired, dict):
        out = {k: None for k in live if k not in desired}
        for k, v in desired.items():
            sub = _diff(live[k], v) if k in live else copy.deepcopy(v)
            if sub is not _SAME:
                out[k] = sub
        return out or _SAME
    return _SAME if live == desired else copy.deepcopy(desired)


def merge_patch(live: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """JSON merge patch (RFC 7386) that makes `live` match `desired` where the operator owns it."""
    patch: dict[str, Any] = {}
    live_meta, want_meta = live.get("metadata", {}), desired.get("metadata", {})
    meta: dict[str, Any] = {}
    for key in _METADATA_MAPS:
        sub = {k: v for k, v in want_meta.get(key, {}).items() if live_meta.get(key, {}).get(k) != v}
        if sub:
            meta[key] = sub
    if want_meta.get("ownerReferences") != live_meta.get("ownerReferences"):
        meta["ownerReferences"] = copy.deepcopy(want_meta.get("ownerReferences"))
    if meta:
        patch["metadata"] = meta
    for key, value in desired.items():
        if key in ("apiVersion", "kind", "metadata"):
            continue
        sub = _diff(live.get(key), value) if key in live else copy.deepcopy(value)
        if sub is not _SAME:
            patch[key] = sub
    return patch


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def _hash(obj: dict[str, Any]) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(naming.SPEC_HASH_ANNOTATION)


async def apply(client: KubeClient, desired: dict[str, Any], owner_uid: str) -> Outcome:
    kind, meta = kind_of(desired), desired["metadata"]
    live = await client.get(kind, meta["namespace"], meta["name"])
    if live is None:
        try:
            await client.create(desired)
            return Outcome.CREATED
        except ApiError as e:
            if e.status != 409:  # someone created it meanwhile: fall through to compare and patch
                raise
            live = await client.get(kind, meta["namespace"], meta["name"])
            if live is None:
                raise
    if not controlled_by(live, owner_uid):
        raise NotOwned(f"{desired['kind']} {meta['name']} already exists and is not controlled by this "
                       "InferenceService: delete or rename it, or rename the InferenceService")
    if _hash(live) == _hash(desired):
        return Outcome.UNCHANGED
    await client.patch(kind, meta["namespace"], meta["name"], merge_patch(live, desired))
    return Outcome.PATCHED


async def prune(client: KubeClient, kind_name: str, namespace: str, name: str, owner_uid: str) -> bool:
    """Delete a child that is no longer desired (only if this InferenceService controls it)."""
    kind = KINDS[kind_name]
    live = await client.get(kind, namespace, name)  # None also when the kind is not installed
    if live is None or not controlled_by(live, owner_uid):
        return False
    await client.delete(kind, namespace, name)
    return True
