"""A cluster facade for operator tests: emulated (kmock) or real (a kubeconfig), same methods.

    async with emulated_cluster() as cluster:        # or: real_cluster("/path/kubeconfig")
        await cluster.create_namespace("t1")
        async with run_operator(cluster):
            await cluster.create(isvc)
            await cluster.wait_for(lambda: ..., "what we wait for")

Differences are explicit: `cluster.emulated` is True when no controllers run, and `settle()` then plays
the Deployment controller (writes the status a real one would); with a real control plane (kwok nodes
make pods ready) `settle()` only waits. On a real control plane the operator can log in with a
kubeconfig of its own (`operator_kubeconfig`: its ServiceAccount's token, so RBAC applies) and watch only
some namespaces (`watch_namespaces`), so it leaves alone what other tests run in the same cluster.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import kopf
import yaml

from baton.operator.crd import build_crd
from baton.operator.kube import KINDS, KubeClient

T = TypeVar("T")


def write_kubeconfig(server: str, directory: str) -> str:
    path = os.path.join(directory, "kubeconfig.yaml")
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "test",
              "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
              "clusters": [{"name": "test", "cluster": {"server": server}}],
              "users": [{"name": "test", "user": {}}]}
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path


@dataclass
class Cluster:
    kubeconfig: str  # what the test itself uses (admin on a real control plane)
    client: KubeClient
    emulated: bool
    api: Any = None  # the ApiServer when emulated
    operator_kubeconfig: str | None = None  # None: the operator uses `kubeconfig`
    watch_namespaces: tuple[str, ...] = ()  # empty: the operator runs cluster-wide

    async def create_namespace(self, name: str) -> None:
        if self.emulated:  # kmock 0.8 cannot parse /api/v1/namespaces; store it directly
            self.api.objects["v1/namespaces", None, name] = {
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
            return
        if await self.client.get(KINDS["Namespace"], None, name) is None:
            await self.client.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.client.create(obj)

    async def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return await self.client.get(KINDS[kind], namespace, name)

    async def patch(self, kind: str, namespace: str | None, name: str, patch: dict[str, Any],
                    sub: str | None = None) -> dict[str, Any]:
        return await self.client.patch(KINDS[kind], namespace, name, patch, sub)

    async def list(self, kind: str, namespace: str | None) -> list[dict[str, Any]]:
        return (await self.client.request("GET", KINDS[kind].path(namespace))).get("items") or []

    async def delete(self, kind: str, namespace: str | None, name: str) -> None:
        await self.client.delete(KINDS[kind], namespace, name)

    async def wait_for(self, probe: Callable[[], Awaitable[T]], what: str, timeout: float = 20.0,
                       interval: float = 0.1) -> T:
        """Poll `probe` until it returns something truthy; fail with `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            last = await probe()
            if last:
                return last
            await asyncio.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")

    async def settle(self, namespace: str, name: str, ready: int | None = None) -> None:
        """Make Deployment `name` report `ready` (default: all) ready pods of its current spec."""
        if not self.emulated:  # real controllers do this; just wait for it (within the tests' 120 s budget)
            try:
                await self.wait_for(lambda: self._deployment_ready(namespace, name), f"{name} ready", 60)
            except AssertionError as e:
                raise AssertionError(f"{e}\n{await self._rollout_report(namespace, name)}") from None
            return
        dep = await self.get("Deployment", namespace, name)
        assert dep is not None, f"Deployment {namespace}/{name} does not exist"
        want = dep["spec"].get("replicas", 1)
        n = want if ready is None else ready
        await self.patch("Deployment", namespace, name, {"status": {
            "observedGeneration": dep["metadata"].get("generation", 1), "replicas": want,
            "updatedReplicas": want, "readyReplicas": n, "availableReplicas": n}}, sub="status")

    async def _rollout_report(self, namespace: str, name: str) -> str:
        """What a stuck rollout looks like: the Deployment's status, its pods, the nodes, the namespace's Events."""
        dep = await self.get("Deployment", namespace, name) or {}
        want = (dep.get("spec", {}).get("selector") or {}).get("matchLabels") or {}
        lines = [f"Deployment {namespace}/{name} status: {dep.get('status')}"]
        for pod in await self.list("Pod", namespace):
            meta = pod["metadata"]
            if all(meta.get("labels", {}).get(k) == v for k, v in want.items()):
                conds = {c["type"]: (c["status"], c.get("reason"), c.get("message"))
                         for c in pod.get("status", {}).get("conditions", [])}
                lines.append(f"  pod {meta['name']} node={pod['spec'].get('nodeName')} "
                             f"phase={pod.get('status', {}).get('phase')} conditions={conds}")
        for node in (await self.client.request("GET", "/api/v1/nodes")).get("items") or []:
            ready = [(c["status"], c.get("lastHeartbeatTime"))
                     for c in node.get("status", {}).get("conditions", []) if c["type"] == "Ready"]
            spec = node["spec"]
            lines.append(f"  node {node['metadata']['name']} ready={ready} "
                         f"unschedulable={spec.get('unschedulable', False)} taints={spec.get('taints')}")
        for ev in (await self.list("Event", namespace))[-15:]:
            obj = ev.get("involvedObject", {})
            lines.append(f"  event {obj.get('kind')}/{obj.get('name')} {ev.get('reason')}: {ev.get('message')}")
        return "\n".join(lines)

    async def _deployment_ready(self, namespace: str, name: str) -> bool:
        dep = await self.get("Deployment", namespace, name)
        st = (dep or {}).get("status", {})
        return bool(dep) and st.get("readyReplicas", 0) == dep["spec"].get("replicas", 1)


@contextlib.asynccontextmanager
async def emulated_cluster(monitoring: bool = False) -> AsyncIterator[Cluster]:
    """A fresh emulated API server on 127.0.0.1 with the core resources and Baton's CRD."""
    import kmock

    from baton_testing.kube.apiserver import ApiServer

    with tempfile.TemporaryDirectory() as tmp:
        async with ApiServer() as api, kmock.Server(api) as server:
            api.declare_core(monitoring=monitoring)
            api.declare_crd(build_crd())
            url = str(server.url).rstrip("/")
            client = KubeClient(lambda: kopf.ConnectionInfo(server=url))
            try:
                yield Cluster(write_kubeconfig(url, tmp), client, emulated=True, api=api)
            finally:
                await client.close()


@contextlib.asynccontextmanager
async def real_cluster(kubeconfig: str, operator_kubeconfig: str | None = None,
                       watch_namespaces: tuple[str, ...] = ()) -> AsyncIterator[Cluster]:
    """A real control plane; installs Baton's CRD if it is missing."""
    from baton.operator.kube import login

    old = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = kubeconfig
    try:
        client = KubeClient(login)
        crd = build_crd()
        if await client.get(KINDS["CustomResourceDefinition"], None, crd["metadata"]["name"]) is None:
            await client.create(crd)
        try:
            yield Cluster(kubeconfig, client, emulated=False, operator_kubeconfig=operator_kubeconfig,
                          watch_namespaces=watch_namespaces)
        finally:
            await client.close()
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
