"""Kubernetes discovery: pure pod mapping, and the real `kubernetes` client against kmock's emulated
API server (list + watch of pods), with fake workers listening on the pods' IPs."""
import asyncio
import socket

import kmock
import pytest
from router_fake_worker import FakeWorker
from router_support import make_config, url_of, wait_until

from baton.router.cli import parse_selector
from baton.router.config import DiscoveryConfig, PolicyName, WorkerRole, WorkerSpec
from baton.router.discovery.pods import is_ready, matches, pod_to_spec, selector_string

PODS = "/api/v1/namespaces/default/pods"


def pod(name: str, ip: str | None = "10.0.0.1", ready: bool = True, phase: str = "Running",
        labels: dict | None = None, annotations: dict | None = None) -> dict:
    status = {"phase": phase, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "default", "labels": labels or {"app": "baton"},
                         "annotations": annotations or {}},
            "status": status}


def test_only_running_ready_pods_with_an_ip_are_workers():
    config = DiscoveryConfig(port=8000)
    assert pod_to_spec(pod("a"), WorkerRole.REGULAR, config) == WorkerSpec("http://10.0.0.1:8000")
    assert pod_to_spec(pod("a", ready=False), WorkerRole.REGULAR, config) is None
    assert pod_to_spec(pod("a", phase="Pending"), WorkerRole.REGULAR, config) is None
    assert pod_to_spec(pod("a", ip=None), WorkerRole.REGULAR, config) is None
    deleting = pod("a")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not is_ready(deleting)
    assert pod_to_spec(pod("a", ip="fd00::1"), WorkerRole.DECODE, config).url == "http://[fd00::1]:8000"


def test_prefill_bootstrap_port_comes_from_the_annotation():
    config = DiscoveryConfig(port=8000)
    annotated = pod("p", annotations={"sglang.ai/bootstrap-port": "9001"})
    assert pod_to_spec(annotated, WorkerRole.PREFILL, config).bootstrap_port == 9001
    assert pod_to_spec(pod("p"), WorkerRole.PREFILL, config).bootstrap_port is None
    bad = pod("p", annotations={"sglang.ai/bootstrap-port": "lots"})
    assert pod_to_spec(bad, WorkerRole.PREFILL, config).bootstrap_port is None
    assert pod_to_spec(annotated, WorkerRole.DECODE, config).bootstrap_port is None


def test_selectors():
    assert parse_selector(["app=baton", "tier=a,zone=b"]) == {"app": "baton", "tier": "a", "zone": "b"}
    with pytest.raises(ValueError):
        parse_selector(["novalue"])
    assert selector_string({"b": "2", "a": "1"}) == "a=1,b=2"
    assert matches(pod("x", labels={"app": "baton", "extra": "1"}), {"app": "baton"})
    assert not matches(pod("x", labels={"app": "other"}), {"app": "baton"})


def _same_port_on(hosts: list[str]) -> int:
    """A port free on every given loopback address (pods share --service-discovery-port)."""
    for _ in range(20):
        socks = []
        try:
            first = socket.socket()
            first.bind((hosts[0], 0))
            socks.append(first)
            port = first.getsockname()[1]
            for host in hosts[1:]:
                s = socket.socket()
                socks.append(s)
                s.bind((host, port))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no common free port")


@pytest.fixture
async def api_server():
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        yield server


async def test_pods_come_and_go_with_readiness(api_server, routers, http):
    port = _same_port_on(["127.0.0.2", "127.0.0.3"])
    a = await FakeWorker("pod-a", host="127.0.0.2", port=port).start()
    b = await FakeWorker("pod-b", host="127.0.0.3", port=port).start()
    try:
        for body in (pod("pod-a", "127.0.0.2"), pod("pod-b", "127.0.0.3", ready=False),
                     pod("stranger", "127.0.0.3", labels={"app": "other"})):
            assert (await api_server.client.post(PODS, json=body)).status == 200
        discovery = DiscoveryConfig(enabled=True, selector={"app": "baton"}, namespace="default", port=port,
                                    resync_secs=30, api_server=str(api_server.url))
        router = await routers(make_config(discovery=discovery, policy=PolicyName.ROUND_ROBIN))
        regular = lambda: sorted(t.worker.url for t in router.workers.routable(WorkerRole.REGULAR))  # noqa: E731
        assert regular() == [a.url]
        async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
            assert (await resp.json())["meta_info"]["worker"] == "pod-a"

        await api_server.client.patch(f"{PODS}/pod-b", json={"status": {"conditions": [
            {"type": "Ready", "status": "True"}]}})
        await wait_until(lambda: regular() == [a.url, b.url], what="pod-b ready")
        for _ in range(2):
            async with http.post(url_of(router, "/generate"), json={"text": "x"}) as resp:
                assert resp.status == 200
        assert len(b.requests) == 1

        await api_server.client.delete(f"{PODS}/pod-a")
        await wait_until(lambda: regular() == [b.url], what="pod-a gone")
        assert [w.url for w in router.workers.workers()] == [b.url]
        assert b'baton_router_discovery_events_total{event="removed",side="regular"} 1.0' in router.metrics.render()
    finally:
        await a.stop()
        await b.stop()


async def test_pd_pods_by_role_selector_with_bootstrap_annotation(api_server, routers):
    await api_server.client.post(PODS, json=pod("p0", "10.1.0.1", labels={"role": "prefill"},
                                                annotations={"sglang.ai/bootstrap-port": "8998"}))
    await api_server.client.post(PODS, json=pod("d0", "10.1.0.2", labels={"role": "decode"}))
    discovery = DiscoveryConfig(enabled=True, prefill_selector={"role": "prefill"},
                                decode_selector={"role": "decode"}, port=30000, api_server=str(api_server.url))
    config = make_config(discovery=discovery, pd_disaggregation=True)
    router = await routers(config, wait_ready=False)
    await wait_until(lambda: len(router.workers.workers()) == 2, what="both pods discovered")
    specs = {w.role: w.spec for w in router.workers.workers()}
    assert specs[WorkerRole.PREFILL] == WorkerSpec("http://10.1.0.1:30000", WorkerRole.PREFILL, 8998)
    assert specs[WorkerRole.DECODE] == WorkerSpec("http://10.1.0.2:30000", WorkerRole.DECODE)
    assert {w.source for w in router.workers.workers()} == {"kubernetes:prefill", "kubernetes:decode"}


async def test_watch_is_restarted_with_a_full_list_at_the_resync_period(api_server, routers):
    discovery = DiscoveryConfig(enabled=True, selector={"app": "baton"}, namespace="default", port=1,
                                resync_secs=0.3, api_server=str(api_server.url))
    router = await routers(make_config(discovery=discovery), wait_ready=False)
    lists = lambda: len(api_server.handler[kmock.action.LIST])  # noqa: E731
    assert await wait_until(lambda: lists() >= 1, what="first list")
    for i in range(40):  # events keep the watch busy; past the resync period the next one ends it
        await api_server.client.post(PODS, json=pod(f"p{i}", f"10.2.0.{i + 1}"))
        if lists() >= 2:
            break
        await asyncio.sleep(0.1)
    assert lists() >= 2
    await wait_until(lambda: len(router.workers.workers()) >= 2, what="pods seen after the resync")
