"""Dashboards and alerts proven against a real Prometheus.

A PD stack runs on loopback: prefill + decode engines (`baton serve`, tiny model, KV over Mooncake
TCP), `baton router` in front (DP-aware), and the real operator (kopf) reconciling the InferenceService
against an emulated API server. Debian's Prometheus scrapes all of them every second with the labels
a cluster gives them (the PodMonitor the operator created, relabeled as the Prometheus Operator does),
loads the chart's alert rules, and answers every dashboard panel query (variables substituted) and
every alert expression: each must parse, and each panel query must return data.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from typing import Any

import httpx
import pytest

from baton.operator import naming
from baton.operator.config import OperatorConfig
from baton_testing.kube.cluster import Cluster, emulated_cluster
from baton_testing.kube.objects import for_create, isvc_body
from baton_testing.kube.runner import run_operator
from prometheus import running_prometheus
from queries import RULES, Query, alert_rules, dashboards, panel_queries, substitute, variable_queries
from scrape_targets import pod_monitor_job, pod_target, static_job
from test_pd_server import PROMPTS, model_path, pd_pair, pd_router  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(480)

NAMESPACE, ISVC = "baton-e2e", "demo"
OPERATOR_NAMESPACE = "baton-system"
MAX_NEW = 8


async def test_every_dashboard_query_and_alert_expression_runs_on_real_data(pd_pair):
    prefill, bootstrap_port, decode = pd_pair
    async with emulated_cluster(monitoring=True) as cluster:
        await cluster.create_namespace(NAMESPACE)
        # resyncs every 2 s: reconciles (and their durations) happen while Prometheus scrapes
        config = OperatorConfig(resync_seconds=2, retry_seconds=0.5, metrics_port=0, metrics_addr="127.0.0.1")
        async with run_operator(cluster, config) as memo:
            await cluster.create(for_create(isvc_body(ISVC, NAMESPACE, monitoring={"podMonitor": True})))
            objects = await _children(cluster)
            operator_url = f"127.0.0.1:{memo.metrics_server.server_port}"
            # the stack and Prometheus block: a thread of their own keeps the API server answering
            await asyncio.to_thread(_run_stack_and_check, objects, operator_url, prefill, bootstrap_port, decode)


async def _children(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """The PodMonitor and the Deployments the operator made, keyed by kind/role."""
    async def probe():
        found = {"PodMonitor": await cluster.get("PodMonitor", NAMESPACE, ISVC)}
        for role in ("prefill", "decode", "router"):
            found[role] = await cluster.get("Deployment", NAMESPACE, f"{ISVC}-{role}")
        return found if all(found.values()) else None
    return await cluster.wait_for(probe, "the operator's PodMonitor and Deployments", timeout=30)


def _run_stack_and_check(objects: dict, operator_url: str, prefill, bootstrap_port: int, decode) -> None:
    cmd = (sys.executable, "-m", "baton", "router", "--dp-aware")
    with pd_router(*cmd, prefill=prefill.base_url, bootstrap_port=bootstrap_port, decode=decode.base_url) as router:
        targets = [pod_target(url.removeprefix("http://"), NAMESPACE, objects[role])
                   for role, url in (("prefill", prefill.base_url), ("decode", decode.base_url),
                                     ("router", router.base_url))]
        jobs = [pod_monitor_job(objects["PodMonitor"], targets, "1s"),
                static_job("baton-operator", operator_url, {"namespace": OPERATOR_NAMESPACE,
                                                            "pod": "baton-operator-7f6d9c5b8-k2m4x"}, "1s")]
        with running_prometheus(jobs, rule_files=[str(RULES)]) as prom:
            started = time.time()  # rate windows below reach back to here: they cover the whole run
            prom.wait_for("count(up == 1)", lambda r: r and float(r[0]["value"][1]) == 4, "4 targets up")
            sent = _send_traffic(router.base_url)
            _wait_scraped(prom, sent)
            at = time.time()  # every query below is evaluated at this instant
            _check_labels(prom, at)
            _check_real_values(prom, at, sent)
            _check_dashboards(prom, at, window_s=math.ceil(at - started) + 2)
            _check_alerts(prom, at)


def _send_traffic(base_url: str) -> int:
    """Bounded traffic through the router: /generate, streamed /v1/completions, one bad request."""
    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as c:
            async def generate(p):
                r = await c.post(f"{base_url}/generate", json={"input_ids": p, "sampling_params": {
                    "max_new_tokens": MAX_NEW, "temperature": 0}})
                return r.status_code

            async def stream(p):
                async with c.stream("POST", f"{base_url}/v1/completions", json={
                        "prompt": p, "max_tokens": MAX_NEW, "temperature": 0, "stream": True}) as r:
                    await r.aread()
                    return r.status_code
            codes = await asyncio.gather(*[generate(p) for p in PROMPTS], *[stream(p) for p in PROMPTS[:4]])
            bad = await c.post(f"{base_url}/generate", content=b"not json")
            return [*codes, bad.status_code]

    codes = asyncio.run(run())
    assert codes[:-1] == [200] * (len(codes) - 1) and codes[-1] == 400, codes
    return len(codes) - 1


def _wait_scraped(prom, sent: int) -> None:
    """Until Prometheus holds the traffic's totals: the router counted every request (and the bad one),
    both engines every KV transfer (the prefill records its side when its poll sees the success, which
    may come after the client's answer)."""
    sel = f'namespace="{NAMESPACE}", inference_service="{ISVC}"'
    for expr, want in ((f"sum(baton_router_requests_total{{{sel}}})", sent + 1),
                       (f'sum(baton_requests_total{{{sel}, role="decode"}})', sent),
                       *((f'sum(baton_kv_transfer_latency_seconds_count{{{sel}, role="{role}"}})', sent)
                         for role in ("prefill", "decode"))):
        prom.wait_for(expr, lambda r, want=want: r and float(r[0]["value"][1]) >= want, f">= {want}", timeout_s=30)
    # rate() needs two samples in its window: a router series born with the traffic and scraped once
    # since (a fast run) has data in an instant query but none in the dashboards' rate panels
    for name in ("baton_router_worker_requests_total", "baton_router_pd_pairs_total",
                 "baton_router_policy_decisions_total"):
        prom.wait_for(f"min(count_over_time({name}{{{sel}}}[1h]))", lambda r: r and float(r[0]["value"][1]) >= 2,
                      f"two scrapes of {name}", timeout_s=30)
    prom.wait_for("sum(changes(baton_operator_reconcile_duration_seconds_count[1h]))",  # a resync, scraped
                  lambda r: r and float(r[0]["value"][1]) > 0, "a reconcile while Prometheus scrapes", timeout_s=30)


def _values(prom, expr: str, at: float) -> list[float]:
    r = prom.query(expr, at)
    assert r["status"] == "success", (expr, r)
    return [float(s["value"][1]) for s in r["data"]["result"]]


def _check_labels(prom, at: float) -> None:
    """The dashboards' variables offer what a cluster's Prometheus would hold."""
    up = _values(prom, f'up{{namespace="{NAMESPACE}", inference_service="{ISVC}"}}', at)
    assert up == [1.0] * 3, ("dashboards and alerts select on the target label inference_service: the PodMonitor "
                             "built by operator/builders/monitoring.py must relabel the pod's "
                             f"{naming.SERVICE_LABEL} label to it (docs/observability.md); got {up}")
    expected = {"namespace": {NAMESPACE, OPERATOR_NAMESPACE}, "isvc": {ISVC}, "role": {"prefill", "decode"}}
    for name, board in dashboards().items():
        for var, label, expr in variable_queries(board):
            expr = substitute(expr, {"namespace": OPERATOR_NAMESPACE if "operator" in name else NAMESPACE,
                                     "isvc": ISVC})
            r = prom.query(expr, at)
            got = {s["metric"].get(label) for s in r["data"]["result"]}
            assert got and got <= expected[var], f"{name}: ${var} offers {got} ({expr})"


def _check_real_values(prom, at: float, sent: int) -> None:
    """A few numbers the traffic must have produced, so the panels show data, not just series."""
    sel = f'namespace="{NAMESPACE}", inference_service="{ISVC}"'
    assert sum(_values(prom, f'baton_router_requests_total{{{sel}}}', at)) >= sent + 1
    assert sum(_values(prom, f'baton_requests_total{{{sel}, role="decode", finish_reason=~"length|stop"}}', at)) >= sent
    for role in ("prefill", "decode"):
        count = sum(_values(prom, f'baton_kv_transfer_latency_seconds_count{{{sel}, role="{role}"}}', at))
        assert count >= sent, f"{role}: {count} transfers for {sent} requests"
        assert sum(_values(prom, f'baton_kv_transfer_bytes_sum{{{sel}, role="{role}"}}', at)) > 0
    assert sum(_values(prom, f'baton_queue_time_seconds_count{{{sel}, role="prefill"}}', at)) >= sent
    assert sum(_values(prom, f'baton_router_errors_total{{{sel}, reason="bad_request"}}', at)) == 1
    assert _values(prom, f'baton_router_dp_rank_in_flight{{{sel}}}', at), "DP-aware router: per-rank series"
    assert sum(_values(prom, 'baton_operator_reconciles_total{trigger="create", result="ok"}', at)) >= 1


def _check_dashboards(prom, at: float, window_s: int) -> None:
    failures, checked = [], 0
    for name, board in dashboards().items():
        values = {"namespace": OPERATOR_NAMESPACE if "operator" in name else NAMESPACE, "isvc": ISVC,
                  "role": ".*", "__rate_interval": f"{window_s}s", "__interval": "1s",
                  "__range": f"{window_s}s"}
        for q in panel_queries(board):
            checked += 1
            failures += _check_panel(prom, Query(q.where, substitute(q.expr, values)), at)
    assert checked >= 60, f"only {checked} panel queries found"
    assert not failures, "\n".join(failures)


def _check_panel(prom, q: Query, at: float) -> list[str]:
    r = prom.query(q.expr, at)
    if r.get("status") != "success":
        return [f"{q.where}: {r.get('error')} in {q.expr}"]
    values = [float(s["value"][1]) for s in r["data"]["result"]]
    if not values:
        return [f"{q.where}: no data for {q.expr}"]
    if not any(math.isfinite(v) for v in values):
        return [f"{q.where}: only NaN/Inf for {q.expr}"]
    return []


def _check_alerts(prom, at: float) -> None:
    rules = alert_rules()
    assert len(rules) >= 10
    for rule in rules:
        r = prom.query(rule["expr"], at)
        assert r.get("status") == "success", f"alert {rule['alert']}: {r.get('error')}"
    deadline = time.monotonic() + 30
    while True:  # Prometheus evaluates each group every second; wait until each rule ran once
        evaluated = {rule["name"]: rule for g in prom.api("rules")["data"]["groups"] for rule in g["rules"]}
        if all(r.get("health") != "unknown" for r in evaluated.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # poll interval, bounded by the deadline
    assert set(evaluated) == {rule["alert"] for rule in rules}
    bad = {n: r.get("lastError") for n, r in evaluated.items() if r.get("health") != "ok"}
    assert not bad, f"rules Prometheus could not evaluate: {bad}"
