"""Kubernetes pod discovery with the official `kubernetes` client: list, then watch from the list's
resourceVersion, and list again at least every `resync_secs` (and after any watch error, e.g. 410
Gone). Needs only get/list/watch on pods.

The client is synchronous, so each selector (one, or prefill + decode) gets a daemon thread; every
change is handed to the event loop, which owns the registry. A pod maps to a worker while it is
Running and Ready; the prefill bootstrap port comes from the `sglang.ai/bootstrap-port` annotation.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes import watch as k8s_watch

from baton.router.config import RouterConfig, WorkerRole, WorkerSpec
from baton.router.discovery.pods import matches, pod_key, pod_to_spec, selector_string
from baton.router.metrics import RouterMetrics
from baton.router.registry import WorkerRegistry

logger = logging.getLogger(__name__)
ERROR_BACKOFF_SECS = 2.0


class KubernetesDiscovery:
    def __init__(self, config: RouterConfig, workers: WorkerRegistry, metrics: RouterMetrics,
                 api_client: k8s_client.ApiClient | None = None) -> None:
        self.config = config
        self.workers = workers
        self.metrics = metrics
        self._api = k8s_client.CoreV1Api(api_client or _default_api_client(config.discovery.api_server))
        self._stop = threading.Event()
        self._watchers: list[_PodWatcher] = []

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        d = self.config.discovery
        if self.config.pd_disaggregation:
            wanted = [(WorkerRole.PREFILL, d.prefill_selector), (WorkerRole.DECODE, d.decode_selector)]
        else:
            wanted = [(WorkerRole.REGULAR, d.selector)]
        for role, selector in wanted:
            if selector:
                watcher = _PodWatcher(self, role, selector, loop)
                self._watchers.append(watcher)
                watcher.start()

    async def stop(self) -> None:
        self._stop.set()
        for watcher in self._watchers:
            watcher.close()

    def apply(self, role: WorkerRole, specs: list[WorkerSpec]) -> None:
        """On the event loop: make the workers discovered for `role` equal `specs`."""
        added, removed = self.workers.sync_source(f"kubernetes:{role.value}", specs)
        if added:
            self.metrics.child(self.metrics.discovery_events, role.value, "added").inc(added)
        if removed:
            self.metrics.child(self.metrics.discovery_events, role.value, "removed").inc(removed)


class _PodWatcher(threading.Thread):
    def __init__(self, owner: KubernetesDiscovery, role: WorkerRole, selector: dict[str, str],
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name=f"baton-discovery-{role.value}", daemon=True)
        self.owner, self.role, self.selector, self.loop = owner, role, selector, loop
        self.config = owner.config.discovery
        self._pods: dict[str, WorkerSpec] = {}
        self._watch: k8s_watch.Watch | None = None

    def run(self) -> None:
        while not self.owner._stop.is_set():
            try:
                self._list_then_watch()
            except Exception as exc:  # API errors, timeouts, 410 Gone: list again after a pause
                if self.owner._stop.is_set():
                    return
                logger.warning("pod discovery (%s) will resync: %s", self.role.value, exc)
                self.owner._stop.wait(ERROR_BACKOFF_SECS)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    def _list_then_watch(self) -> None:
        items, version = self._list()
        self._pods = {pod_key(p): s for p in items if (s := self._spec(p)) is not None}
        self._publish()
        deadline = time.monotonic() + self.config.resync_secs
        self._watch = k8s_watch.Watch()
        stream = self._watch.stream(self._list_fn(), resource_version=version, deserialize=False,
                                    **self._query(watch=True))
        for event in stream:  # ERROR events (410 Gone, ...) raise ApiException: run() lists again
            self._on_event(event.get("type", ""), event.get("object") or {})
            if self.owner._stop.is_set() or time.monotonic() > deadline:
                self._watch.stop()
                return

    def _list(self) -> tuple[list[dict[str, Any]], str | None]:
        resp = self._list_fn()(_preload_content=False, **self._query(watch=False))
        data = json.loads(resp.data)
        return data.get("items") or [], (data.get("metadata") or {}).get("resourceVersion")

    def _on_event(self, kind: str, pod: dict[str, Any]) -> None:
        key = pod_key(pod)
        spec = None if kind == "DELETED" else self._spec(pod)
        if spec is None:
            changed = self._pods.pop(key, None) is not None
        else:
            changed = self._pods.get(key) != spec
            self._pods[key] = spec
        if changed:
            self._publish()

    def _spec(self, pod: dict[str, Any]) -> WorkerSpec | None:
        return pod_to_spec(pod, self.role, self.config) if matches(pod, self.selector) else None

    def _publish(self) -> None:
        specs = list(self._pods.values())
        self.loop.call_soon_threadsafe(self.owner.apply, self.role, specs)

    def _list_fn(self):
        api = self.owner._api
        if self.config.namespace:
            return lambda **kw: api.list_namespaced_pod(self.config.namespace, **kw)
        return api.list_pod_for_all_namespaces

    def _query(self, watch: bool) -> dict[str, Any]:
        query: dict[str, Any] = {"label_selector": selector_string(self.selector)}
        if watch:  # the server ends the watch at the resync time; the read timeout catches one that does not
            query["timeout_seconds"] = max(1, int(self.config.resync_secs))
            query["_request_timeout"] = (10, self.config.resync_secs + 10)
        return query


def _default_api_client(api_server: str | None) -> k8s_client.ApiClient:
    if api_server:
        configuration = k8s_client.Configuration()
        configuration.host = api_server.rstrip("/")
        return k8s_client.ApiClient(configuration)
    try:
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        k8s_config.load_kube_config()
    return k8s_client.ApiClient()
