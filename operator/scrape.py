"""Reading an engine pod's own `/metrics` for the planner (no Prometheus needed): what `planner.PodSample`
holds, from the metric names of docs/metrics.md. The operator reaches the pods on their IP and the engine
port, as Prometheus would (a NetworkPolicy must let it)."""
from __future__ import annotations

import asyncio
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
    usage: list[float] = []
    values = {"queued_tokens": 0.0, "ttft_sum": 0.0, "ttft_count": 0.0, "itl_sum": 0.0, "itl_count": 0.0}
    wanted = {"baton_num_queued_tokens": "queued_tokens",
              "baton_time_to_first_token_seconds_sum": "ttft_sum",
              "baton_time_to_first_token_seconds_count": "ttft_count",
              "baton_inter_token_latency_seconds_sum": "itl_sum",
              "baton_inter_token_latency_seconds_count": "itl_count"}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "baton_token_usage":
                usage.append(s.value)
            elif s.name in wanted:
                values[wanted[s.name]] += s.value
    return PodSample(pod, kv_usage=sum(usage) / len(usage) if usage else 0.0, **values)


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
