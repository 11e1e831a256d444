"""Reading the engines' metrics for the planner: what `planner.PodSample` holds, from the metric names of
docs/metrics.md. Two sources give the same samples:

- a pod's own `/metrics` (no Prometheus needed): the operator reaches the pods on their IP and the engine
  port, as Prometheus would (the engines' NetworkPolicy lets the operator's pods in; `/metrics` needs no
  API key);
- Prometheus (`--prometheus-url`, for services with `monitoring` on): one instant query for the series
  of the Ready pods, by the `namespace` and `pod` labels its PodMonitor / ServiceMonitor give them."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from baton.operator import naming
from baton.operator.planner import PodSample

SCRAPE_TIMEOUT_S = 5.0


def pod_metrics_url(pod: Mapping[str, Any]) -> str | None:
    """Where a pod's engine serves /metrics (None before it has an IP)."""
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{naming.ENGINE_PORT}/metrics" if ip else None


def parse_metrics(pod: str, text: str) -> PodSample:
    """One engine's exposition: gauges per DP rank (KV usage averaged, queued tokens summed), the TTFT
    and ITL histograms' running sum and count."""
    return _sample(pod, [(s.name, s.value) for family in text_string_to_metric_families(text)
                         for s in family.samples])


_WANTED = {"baton_num_queued_tokens": "queued_tokens",
           "baton_time_to_first_token_seconds_sum": "ttft_sum",
           "baton_time_to_first_token_seconds_count": "ttft_count",
           "baton_inter_token_latency_seconds_sum": "itl_sum",
           "baton_inter_token_latency_seconds_count": "itl_count"}


def _sample(pod: str, series: list[tuple[str, float]]) -> PodSample:
    """(metric name, value) pairs of one pod -> its sample: KV usage averaged over DP ranks, the rest summed."""
    usage = [v for name, v in series if name == "baton_token_usage"]
    values = dict.fromkeys(_WANTED.values(), 0.0)
    for name, v in series:
        if name in _WANTED:
            values[_WANTED[name]] += v
    return PodSample(pod, kv_usage=sum(usage) / len(usage) if usage else 0.0, **values)


async def query_prometheus(session: aiohttp.ClientSession, base_url: str, namespace: str,
                           pods: list[str]) -> dict[str, PodSample]:
    """The pods' samples from Prometheus' latest values (a pod it has no series of yet is left out, as a
    pod that does not answer a scrape is); {} when Prometheus does not answer."""
    if not pods:
        return {}
    names = "|".join(["baton_token_usage", *_WANTED])
    pod_re = "|".join(re.escape(p) for p in pods).replace("\\", "\\\\")  # a regex inside a PromQL string
    query = f'{{__name__=~"{names}",namespace="{namespace}",pod=~"{pod_re}"}}'
    try:
        async with session.get(f"{base_url.rstrip('/')}/api/v1/query", params={"query": query},
                               timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return {}
    if resp.status != 200 or body.get("status") != "success":
        return {}
    by_pod: dict[str, list[tuple[str, float]]] = {}
    for series in body["data"]["result"]:
        labels = series["metric"]
        by_pod.setdefault(labels["pod"], []).append((labels["__name__"], float(series["value"][1])))
    return {pod: _sample(pod, series) for pod, series in by_pod.items()}


async def scrape(session: aiohttp.ClientSession, pod: str, url: str) -> PodSample | None:
    """The pod's sample; None when it does not answer (starting, stopping, unreachable)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
            if resp.status != 200:
                return None
            return parse_metrics(pod, await resp.text())
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
        return None


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, Ready and not terminating: a pod that serves (a draining one has left already)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


MetricsUrl = Callable[[Mapping[str, Any]], "str | None"]
