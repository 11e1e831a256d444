"""The planner's loop body (spec.autoscaling.mode planner), kopf-free: scrape the Ready engine pods of
each planned role, plan (`baton.operator.planner`), set the Deployments' replicas, and say why in the
status (`status.autoscaling`) and, for each change, in an Event (ScaledUp / ScaledDown).

The engine Deployments of planned roles carry `baton.dev/replicas: planner`, so a reconcile never resets
what the planner set (the same rule as for an HPA in mode external). The scraped series live in the
operator's memory; the stabilisation memory (each step's recommendation per role, over the longer
scale window) and each role's last scale time are in the status too, and a restarted operator takes them
back (PlannerState.from_status): a scale-down still waits out its window across a restart, where a fresh
memory would follow the first quiet scrapes at once.
"""
from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from baton.operator import naming
from baton.operator.kube import KINDS, KubeClient
from baton.operator.naming import Role
from baton.operator.planner import Plan, PlannerConfig, Recommendation, Sample, plan
from baton.operator.scrape import MetricsUrl, is_ready, pod_metrics_url, query_prometheus, scrape
from baton.operator.spec import InferenceService

Emit = Callable[[str, str], None]  # (reason, message) -> an Event on the InferenceService


@dataclass
class PlannerState:
    """What one InferenceService's planner keeps between steps."""

    samples: list[Sample] = field(default_factory=list)
    memory: tuple[Recommendation, ...] = ()
    last_scale: dict[str, str] = field(default_factory=dict)  # role key -> time of its last change

    def keep(self, config: PlannerConfig, now: float) -> None:
        horizon = now - config.window_seconds - config.interval_seconds
        self.samples = [s for s in self.samples if s.at >= horizon]

    @classmethod
    def from_status(cls, autoscaling: Mapping[str, Any] | None) -> "PlannerState":
        """What a previous operator left in `status.autoscaling` (planner_status): the recommendations
        and last scale times; entries it cannot read are skipped."""
        roles = {r.spec_key: r for r in Role}
        memory, last_scale = [], {}
        for entry in (autoscaling or {}).get("recommendations") or []:
            try:
                memory.append(Recommendation(parse_iso(entry["at"]), roles[entry["role"]], int(entry["replicas"])))
            except (KeyError, TypeError, ValueError):
                continue
        for key in roles:
            when = ((autoscaling or {}).get(key) or {}).get("lastScaleTime")
            if isinstance(when, str):
                last_scale[key] = when
        return cls(memory=tuple(sorted(memory, key=lambda r: r.at)), last_scale=last_scale)


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()


async def _scrape_role(session: aiohttp.ClientSession, pods: list[Mapping[str, Any]], role: Role,
                       metrics_url: MetricsUrl, now: float, prometheus: tuple[str, str] | None = None) -> Sample:
    """`prometheus`: (its URL, the namespace) to read the pods' series from, instead of scraping them."""
    mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(naming.ROLE_LABEL) == role.value
            and is_ready(p)]
    if prometheus is not None:
        got = await query_prometheus(session, *prometheus, [p["metadata"]["name"] for p in mine])
        return Sample(now, role, tuple(got[p["metadata"]["name"]] for p in mine if p["metadata"]["name"] in got))
    targets = [(p["metadata"]["name"], metrics_url(p)) for p in mine]
    scraped = await asyncio.gather(*(scrape(session, name, url) for name, url in targets if url))
    return Sample(now, role, tuple(s for s in scraped if s is not None))


async def planner_step(client: KubeClient, session: aiohttp.ClientSession, isvc: InferenceService,
                       state: PlannerState, now: float, emit: Emit,
                       metrics_url: MetricsUrl = pod_metrics_url, prometheus_url: str | None = None) -> Plan | None:
    """One scrape-plan-apply step; None when the service has no planned role (or its Deployments are not
    there yet: the reconcile creates them). With `prometheus_url`, a service whose `monitoring` has
    Prometheus scrape it is read from there (docs/operator.md), others are scraped directly."""
    config = isvc.spec.planner
    if config is None or not config.roles:
        return None
    deployments = {r: await client.get(KINDS["Deployment"], isvc.namespace, naming.child_name(isvc.name, r))
                   for r in config.roles}
    if any(d is None for d in deployments.values()):
        return None
    replicas = {r: d["spec"].get("replicas", 1) for r, d in deployments.items()}
    monitored = isvc.spec.monitoring.pod_monitor or isvc.spec.monitoring.service_monitor
    prometheus = (prometheus_url, isvc.namespace) if prometheus_url and monitored else None
    pods = await client.list(KINDS["Pod"], isvc.namespace, {naming.SERVICE_LABEL: isvc.name})
    pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(naming.SERVICE_LABEL) == isvc.name]
    for role in config.roles:
        state.samples.append(await _scrape_role(session, pods, role, metrics_url, now, prometheus))
    state.keep(config, now)
    result = plan(config, state.samples, replicas, state.memory, now)
    state.memory = result.memory
    for role, rp in result.roles.items():
        if rp.replicas != rp.current:
            await client.patch(KINDS["Deployment"], isvc.namespace, naming.child_name(isvc.name, role),
                               {"spec": {"replicas": rp.replicas}})
            state.last_scale[role.spec_key] = iso(now)
            emit("ScaledUp" if rp.replicas > rp.current else "ScaledDown", rp.reason)
    await client.patch(KINDS[naming.KIND], isvc.namespace, isvc.name,
                       {"status": {"autoscaling": planner_status(result, state, now)}}, sub="status")
    return result


def planner_status(result: Plan, state: PlannerState, now: float) -> dict[str, Any]:
    out: dict[str, Any] = {"lastDecisionTime": iso(now),
                           "recommendations": [{"role": r.role.spec_key, "at": iso(r.at), "replicas": r.replicas}
                                               for r in result.memory]}
    for role, rp in result.roles.items():
        entry: dict[str, Any] = {"replicas": rp.replicas, "reason": rp.reason,
                                 "observed": {k: round(v, 6) for k, v in rp.observed.items()}}
        if role.spec_key in state.last_scale:
            entry["lastScaleTime"] = state.last_scale[role.spec_key]
        out[role.spec_key] = entry
    return out
