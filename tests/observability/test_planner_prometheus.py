"""The planner's Prometheus source against a real Prometheus (Debian's): two engine "pods" serve the
engine's own exposition (baton.engine.metrics.EngineMetrics, fed scheduler infos and request latencies)
on loopback; Prometheus scrapes them with the namespace and pod labels a PodMonitor gives; the samples
the planner reads from Prometheus equal the ones it scrapes from the pods themselves."""
from __future__ import annotations

import asyncio
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

import aiohttp
import pytest
from prometheus_client import make_wsgi_app

from baton.engine.bench.launcher import free_port
from baton.engine.metrics import EngineMetrics
from baton.operator import naming
from baton.operator.autoscaler import _scrape_role
from baton.operator.naming import Role
from baton.operator.scrape import query_prometheus, scrape
from prometheus import running_prometheus
from scrape_targets import static_job

NAMESPACE = "team-a"


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _engine(usage: list[float], queued: int, ttfts: list[float], itls: list[float]) -> EngineMetrics:
    """An engine's metrics as its HTTP server would expose them: one scheduler info per DP rank."""
    m = EngineMetrics("tiny", "decode")
    m.update_from_server_infos([{"dp_rank": r, "token_usage": u, "num_waiting_tokens": queued}
                                for r, u in enumerate(usage)])
    for t in ttfts:
        m.ttft.observe(t)
    for t in itls:
        m.itl.observe(t)
    return m


def _pod(name: str, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "labels": {naming.ROLE_LABEL: Role.DECODE.value}},
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_prometheus_source_equals_scraping_the_pods():
    engines = {"demo-decode-0": _engine([0.5, 0.7], 11, [0.2, 0.4], [0.01, 0.03, 0.02]),
               "demo-decode-1": _engine([0.1], 0, [], [0.05])}
    servers = []
    try:
        for pod, metrics in engines.items():
            srv = make_server("127.0.0.1", free_port(), make_wsgi_app(metrics.registry), handler_class=_Quiet)
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append((pod, srv))
        jobs = [static_job(pod, f"127.0.0.1:{srv.server_port}", {"namespace": NAMESPACE, "pod": pod}, "1s")
                for pod, srv in servers]
        with running_prometheus(jobs) as prom:
            prom.wait_for("count(baton_token_usage)", lambda r: r and float(r[0]["value"][1]) == 3,
                          "both pods' KV usage series")
            pods = [*engines, "demo-decode-9"]  # a pod Prometheus has no series of: left out

            async def both():
                async with aiohttp.ClientSession() as session:
                    via = await query_prometheus(session, prom.base_url, NAMESPACE, pods)
                    direct = {pod: await scrape(session, pod, f"http://127.0.0.1:{srv.server_port}/metrics")
                              for pod, srv in servers}
                    elsewhere = await query_prometheus(session, prom.base_url, "team-b", pods)
                    down = await query_prometheus(session, f"http://127.0.0.1:{free_port()}", NAMESPACE, pods)
                    # the planner's step: the role's Ready pods, read from Prometheus
                    role = await _scrape_role(session, [_pod(p) for p in pods] + [_pod("demo-decode-2", ready=False)],
                                              Role.DECODE, lambda pod: None, 1.0, (prom.base_url, NAMESPACE))
                    return via, direct, elsewhere, down, role

            via, direct, elsewhere, down, role = asyncio.run(both())
        assert [s.pod for s in role.pods] == list(engines) and list(role.pods) == [via[p] for p in engines]
        assert via == direct, "Prometheus and the pods' own /metrics give the planner the same samples"
        assert via["demo-decode-0"].kv_usage == pytest.approx(0.6) and via["demo-decode-0"].queued_tokens == 22
        assert via["demo-decode-0"].ttft_count == 2 and via["demo-decode-1"].itl_sum == pytest.approx(0.05)
        assert elsewhere == {} and down == {}, "another namespace's pods, or no Prometheus: no samples"
    finally:
        for _, srv in servers:
            srv.shutdown()
            srv.server_close()
