"""An emulated Kubernetes API server: kmock's emulator plus the API-server behaviour the operator
relies on (kmock stores JSON and merges patches; it knows nothing of Kubernetes semantics):

- uid, creationTimestamp, resourceVersion on writes; metadata.generation, for the kinds that have one
  in Kubernetes (Deployments, CRDs, custom resources), bumped on spec changes;
- status subresource: `/status` patches change only `.status`, main patches never change it;
- only declared resources exist (creating a PodMonitor without its CRD is a 404, as in a cluster);
- garbage collection: deleting an owner deletes the objects whose ownerReferences name its uid
  (what kube-controller-manager does, synchronously here).

Controllers are not emulated: Deployments get no status unless a test writes it (`Cluster.settle`).
"""
from __future__ import annotations

import copy
import datetime
import itertools
import uuid
from typing import Any

import kmock
from kmock._internal import dicts, enums  # the emulator's own merge-patch, to predict the result

CORE = [("v1", "namespaces", "Namespace", False, ()), ("v1", "services", "Service", True, ("status",)),
        ("v1", "serviceaccounts", "ServiceAccount", True, ()), ("v1", "configmaps", "ConfigMap", True, ()),
        ("v1", "secrets", "Secret", True, ()), ("v1", "pods", "Pod", True, ("status",)),
        ("v1", "events", "Event", True, ()),
        ("apps/v1", "deployments", "Deployment", True, ("status", "scale")),
        ("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", True, ("status",)),
        ("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy", True, ()),
        ("rbac.authorization.k8s.io/v1", "roles", "Role", True, ()),
        ("rbac.authorization.k8s.io/v1", "rolebindings", "RoleBinding", True, ()),
        ("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition", False, ("status",))]
MONITORING = [("monitoring.coreos.com/v1", "podmonitors", "PodMonitor", True, ()),
              ("monitoring.coreos.com/v1", "servicemonitors", "ServiceMonitor", True, ())]
VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}
# Kinds whose objects carry metadata.generation in a real cluster (ConfigMaps, Services etc. do not).
WITH_GENERATION = {"Deployment", "CustomResourceDefinition", "PodMonitor", "ServiceMonitor"}


class ApiServer(kmock.KubernetesEmulator):
    """Use as `async with ApiServer() as api, kmock.Server(api) as server:`; then `declare_core()`."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.declared: dict[tuple[str, str], dict[str, Any]] = {}  # (apiVersion, plural) -> info
        self._versions = itertools.count(1)

    def declare(self, api_version: str, plural: str, kind: str, namespaced: bool,
                subresources: tuple[str, ...] = (), generation: bool | None = None) -> None:
        self.resources[f"{api_version}/{plural}"] = kmock.ResourceInfo(
            kind=kind, namespaced=namespaced, verbs=VERBS, subresources=set(subresources))
        self.declared[(api_version, plural)] = {
            "kind": kind, "subresources": set(subresources),
            "generation": kind in WITH_GENERATION if generation is None else generation}

    def declare_core(self, monitoring: bool = False) -> None:
        for spec in CORE + (MONITORING if monitoring else []):
            self.declare(*spec)

    def declare_crd(self, crd: dict[str, Any]) -> None:
        """Install a CRD: the object itself and its resource in discovery."""
        s = crd["spec"]
        for v in s["versions"]:
            self.declare(f"{s['group']}/{v['name']}", s["names"]["plural"], s["names"]["kind"],
                         s["scope"] == "Namespaced", tuple(v.get("subresources", {})), generation=True)
        self.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, crd["metadata"]["name"]] = \
            copy.deepcopy(crd)

    def _info(self, request: Any) -> dict[str, Any] | None:
        res = request.resource
        api_version = f"{res.group}/{res.version}" if res.group else res.version
        return self.declared.get((api_version, res.plural))

    def _next_version(self) -> str:
        return str(next(self._versions))

    async def _handle(self, request: Any) -> Any:
        res = request.resource
        if res is not None and res.plural and request.action is not None:
            info = self._info(request)
            if info is None:
                raise kmock.KubernetesResourceNotFoundError()
            if request.action == enums.action.CREATE and isinstance(request.data, dict):
                self._on_create(request.data, info)
            elif request.action == enums.action.UPDATE and isinstance(request.data, dict):
                self._on_patch(request, info)
        key = (request.resource, request.namespace, request.name)
        uid = self._uid_of(key) if request.name else None
        response = await super()._handle(request)
        if uid is not None and self.objects[key].deleted:  # deleted now, finalizers done
            await self._collect_garbage(uid)
        return response

    def _on_create(self, data: dict[str, Any], info: dict[str, Any]) -> None:
        meta = data.setdefault("metadata", {})
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_version(),
                    creationTimestamp=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
        if info["generation"]:
            meta["generation"] = 1
        if "status" in info["subresources"]:
            data.pop("status", None)

    def _on_patch(self, request: Any, info: dict[str, Any]) -> None:
        data = request.data
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return  # the emulator answers 404
        live = self.objects[key].raw
        if request.subresource == "status":
            for k in list(data):
                if k != "status":
                    del data[k]
        elif "status" in info["subresources"]:
            data.pop("status", None)
        after = dicts.patch_dict(copy.deepcopy(live), data)
        meta = data.setdefault("metadata", {})
        meta["resourceVersion"] = self._next_version()
        if info["generation"] and after.get("spec") != live.get("spec"):
            meta["generation"] = live.get("metadata", {}).get("generation", 1) + 1
        for k in ("uid", "creationTimestamp"):  # immutable
            meta.pop(k, None) if k in live.get("metadata", {}) else None

    def _uid_of(self, key: tuple[Any, str | None, str]) -> str | None:
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key].get("metadata", {}).get("uid")
        return None

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Delete dependents of a deleted owner (recursively), with watch events."""
        for key in list(self.objects):
            obj = self.objects[key]
            if obj.deleted:
                continue
            refs = obj.get("metadata", {}).get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs):
                async with self._lock:
                    raw = obj.raw
                    obj.delete()
                    await self._buses[key[0]].put({"type": "DELETED", "object": raw})
                await self._collect_garbage(raw.get("metadata", {}).get("uid", ""))
