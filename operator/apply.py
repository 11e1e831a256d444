"""Create-or-patch of one desired child, by spec hash and by drift; and the JSON merge patch it sends.

A child is patched when its spec-hash annotation differs from the desired one (the spec changed), or
when it no longer holds what the desired object says (drift: someone changed its image, widened a Role,
pointed a Service elsewhere). A reconcile of an unchanged spec on untouched children writes nothing
(restarts are no-ops) and a change touches exactly the children whose desired object changed. The patch
makes the child's owned fields equal to the desired object: keys the desired object drops are removed;
labels/annotations added by others are kept.
"""
from __future__ import annotations

import copy
import enum
import re
from typing import Any

from baton.operator import naming
from baton.operator.builders.common import external_replicas
from baton.operator.kube import KINDS, ApiError, KubeClient, kind_of

_SAME = object()
_METADATA_MAPS = ("labels", "annotations")


class Outcome(str, enum.Enum):
    CREATED = "created"
    PATCHED = "patched"
    CORRECTED = "corrected"  # same spec, but the live object had drifted from it
    UNCHANGED = "unchanged"


class NotOwned(Exception):
    """A child's name is taken by an object this InferenceService does not control."""


class PredecessorLeft(Exception):
    """A child of a deleted InferenceService of the same name is still being deleted: try again soon."""


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
    if external_replicas(live) and not external_replicas(desired):  # back to static replicas: say so
        meta.setdefault("annotations", {})[naming.REPLICAS_ANNOTATION] = None
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


_QUANTITY = re.compile(r"^([+-]?[0-9.]+)(e[+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$")
_SUFFIX = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
# an extra key or rule here widens or moves what it means (a Role's rules, a NetworkPolicy's peers)
EXACT_KEYS = ("selector", "rules", "podSelector", "ingress")


def _quantity(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _QUANTITY.match(value) if isinstance(value, str) else None
    if m is None:
        return None
    number, suffix = m.groups()
    try:
        base = float(number)
    except ValueError:
        return None
    if suffix and suffix.startswith("e"):
        return base * 10 ** int(suffix[1:])
    return base * _SUFFIX.get(suffix or "", 1)


def holds(live: Any, desired: Any) -> bool:
    """Whether `live` (as the API server returns it) still says what `desired` says: every desired
    key is there with an equal value. Fields the API server adds (defaults, status, others' labels) do
    not count; a desired empty or false value matches a missing key (the API server drops those);
    quantities compare by value (`0.5` is stored as `500m`); lists must match element by element."""
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return False
        for k, v in desired.items():
            if k not in live:
                if v not in (None, False, 0, "", [], {}):
                    return False
            elif k in EXACT_KEYS and isinstance(v, (dict, list)):
                if not (holds(live[k], v) and holds(v, live[k])):
                    return False
            elif not holds(live[k], v):
                return False
        return True
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(holds, live, desired))
    if live == desired:
        return True
    q_live, q_desired = _quantity(live), _quantity(desired)
    return q_live is not None and q_live == q_desired


def drift(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """The owned parts of `live` differ from `desired` (metadata: only its labels and annotations)."""
    meta, want = live.get("metadata", {}), desired.get("metadata", {})
    body = {k: v for k, v in desired.items() if k not in ("apiVersion", "kind", "metadata")}
    return not (holds(meta, {k: want[k] for k in ("labels", "annotations") if k in want}) and
                holds({k: v for k, v in live.items() if k in body}, body))


def controlled_by(obj: dict[str, Any], uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def left_by_predecessor(live: dict[str, Any], desired: dict[str, Any]) -> bool:
    """`live` is controlled by an InferenceService of the desired owner's name but another uid: one
    that was deleted (names are unique in a namespace), whose children garbage collection has not
    removed yet."""
    want = next((r for r in desired["metadata"].get("ownerReferences") or [] if r.get("controller")), None)
    refs = live.get("metadata", {}).get("ownerReferences") or []
    have = next((r for r in refs if r.get("controller")), None)
    return (want is not None and have is not None and have.get("uid") != want["uid"]
            and (have.get("apiVersion"), have.get("kind"), have.get("name")) ==
            (naming.API_VERSION, naming.KIND, want["name"]))


def keep_live_replicas(live: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """`desired` with the live replicas where an HPA or KEDA owns them, so neither a patch nor the drift
    check ever resets what the autoscaler set (the count in the spec applies at creation only)."""
    if not external_replicas(desired) or "replicas" not in (live.get("spec") or {}):
        return desired
    out = copy.deepcopy(desired)
    out["spec"]["replicas"] = live["spec"]["replicas"]
    return out


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
    if not controlled_by(live, owner_uid) and left_by_predecessor(live, desired):
        # delete it now rather than wait for garbage collection (a NameTaken meanwhile)
        if not live["metadata"].get("deletionTimestamp"):
            await client.delete(kind, meta["namespace"], meta["name"])
        try:
            await client.create(desired)
        except ApiError as e:
            if e.status != 409:
                raise
            raise PredecessorLeft(f"{desired['kind']} {meta['name']} of the deleted InferenceService of the "
                                  "same name is still being deleted") from e
        return Outcome.CREATED
    if not controlled_by(live, owner_uid):
        raise NotOwned(f"{desired['kind']} {meta['name']} already exists and is not controlled by this "
                       "InferenceService: delete or rename it, or rename the InferenceService")
    desired = keep_live_replicas(live, desired)
    if _hash(live) == _hash(desired):
        if not drift(live, desired):
            return Outcome.UNCHANGED
        await client.patch(kind, meta["namespace"], meta["name"], merge_patch(live, desired))
        return Outcome.CORRECTED
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
