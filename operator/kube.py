"""A small async Kubernetes REST client for the operator's children (kopf itself only watches).

Plain REST over aiohttp: GET/POST/JSON-merge-PATCH/DELETE by kind and name, credentials from kopf's
login helpers (service account in a pod, else kubeconfig). Names, not label selectors, find children,
so it behaves the same against a real API server and an emulated one; the one list (pods, for the
status) is filtered again by its caller.
"""
from __future__ import annotations

import json
import logging
import os
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from baton.operator import naming

MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = f"/api/{self.api_version}" if "/" not in self.api_version else f"/apis/{self.api_version}"
        parts = [base]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        parts += [p for p in (name, sub) if p]
        return "/".join(parts)


KINDS = {k.kind: k for k in (
    Kind("v1", "Namespace", "namespaces", namespaced=False),
    Kind("v1", "Service", "services"),
    Kind("v1", "ServiceAccount", "serviceaccounts"),
    Kind("v1", "ConfigMap", "configmaps"),
    Kind("v1", "Secret", "secrets"),
    Kind("v1", "Pod", "pods"),
    Kind("v1", "Event", "events"),
    Kind("apps/v1", "Deployment", "deployments"),
    Kind("batch/v1", "Job", "jobs"),
    Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
    Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
    Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
    Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
    Kind("monitoring.coreos.com/v1", "PodMonitor", "podmonitors"),
    Kind("monitoring.coreos.com/v1", "ServiceMonitor", "servicemonitors"),
    Kind("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", namespaced=False),
    Kind(naming.API_VERSION, naming.KIND, naming.PLURAL),
)}


def kind_of(obj: dict[str, Any]) -> Kind:
    kind = KINDS[obj["kind"]]
    assert kind.api_version == obj["apiVersion"], f"unexpected apiVersion of {obj['kind']}"
    return kind


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def retriable(self) -> bool:
        """Conflicts, throttling and server-side trouble pass; 4xx config errors do not."""
        return self.status in (409, 429) or self.status >= 500


def login(logger: logging.Logger | None = None) -> kopf.ConnectionInfo:
    """In a pod: its service account. Elsewhere: the kubeconfig, through the kubernetes client when
    it is installed (exec plugins, auth providers), else kopf's minimal kubeconfig reader."""
    settings = kopf.OperatorSettings()
    info = kopf.login_with_service_account(settings=settings)
    if info is None:
        info = _login_via_client(settings)
    if info is None:
        info = kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise kopf.LoginError("no service account and no kubeconfig: cannot reach Kubernetes")
    return info


def _login_via_client(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo | None:
    """kopf.login_via_client, but reading $KUBECONFIG as it is now. The kubernetes client reads it once,
    when first imported, so kopf's helper logs in with whatever file was current then: in a process
    that changes it (tests running the operator as a ServiceAccount) that is the wrong identity."""
    try:
        import kubernetes.client
        import kubernetes.config
    except ImportError:
        return None
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None,
                                           client_configuration=config, persist_config=False)
    except (kubernetes.config.ConfigException, OSError):
        return None
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    return kopf.ConnectionInfo(
        server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
        username=config.username or None, password=config.password or None, scheme=scheme, token=token,
        certificate_path=config.cert_file, private_key_path=config.key_file,
        trust_env=settings.networking.trust_env, priority=10)  # kopf's PRIORITY_OF_CLIENT


def _decode(text: str) -> dict[str, Any]:
    """A JSON object answer, or {"message": text}: a real API server answers a path of an API group
    that is not installed (a CRD missing) with a plain-text `404 page not found`."""
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        return {"message": text.strip()}
    return data if isinstance(data, dict) else {"message": text.strip()}


class KubeClient:
    """One aiohttp session; re-logs in once on 401 (tokens rotate)."""

    def __init__(self, login_fn: Callable[[], kopf.ConnectionInfo] = login):
        self._login_fn = login_fn
        self._info: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _connect(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._info = self._login_fn()
            headers = {"User-Agent": naming.OPERATOR_NAME, **self._info.as_http_headers()}
            ssl = self._info.as_ssl_context() if self._info.server.startswith("https") else False
            self._session = aiohttp.ClientSession(
                base_url=self._info.server.rstrip("/") + "/", headers=headers,
                connector=aiohttp.TCPConnector(ssl=ssl), timeout=aiohttp.ClientTimeout(total=30))
        return self._session

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json") -> dict[str, Any]:
        for attempt in range(2):
            session = self._connect()
            kwargs: dict[str, Any] = {}
            if body is not None:
                kwargs.update(json=body, headers={"Content-Type": content_type})
            async with session.request(method, path.lstrip("/"), **kwargs) as resp:
                data = _decode(await resp.text())
                if resp.status == 401 and attempt == 0:
                    await self.close()  # stale token: log in again
                    continue
                if resp.status >= 400:
                    raise ApiError(resp.status, data.get("reason", resp.reason or ""),
                                   data.get("message", str(data)))
                return data
        raise AssertionError("unreachable")

    async def get(self, kind: Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self.request("GET", kind.path(namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: Kind, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects of `kind` in `namespace` with these labels (an emulated server may ignore them)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        query = urllib.parse.urlencode({"labelSelector": selector})
        return (await self.request("GET", f"{kind.path(namespace)}?{query}")).get("items") or []

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        kind = kind_of(obj)
        return await self.request("POST", kind.path(obj["metadata"].get("namespace")), obj)

    async def patch(self, kind: Kind, namespace: str | None, name: str, patch: dict[str, Any],
                    sub: str | None = None) -> dict[str, Any]:
        return await self.request("PATCH", kind.path(namespace, name, sub), patch, MERGE_PATCH)

    async def delete(self, kind: Kind, namespace: str | None, name: str) -> None:
        try:
            await self.request("DELETE", kind.path(namespace, name), {"propagationPolicy": "Background"})
        except ApiError as e:
            if e.status != 404:
                raise
