"""The P:D planner (spec.autoscaling.mode planner): the engines' own metrics in, replicas per role out.

Pure: `plan(config, samples, replicas, memory, now)` is a function of the scraped series, the config and
the clock (tests replay recorded series). `baton.operator.autoscaler` scrapes, keeps the series and the
memory between steps, and applies the plan.

Per role, every target the user set gives a recommendation, proportional as the HPA's:
`ceil(pods * observed / target)` (kept at `pods` within a 10% tolerance); the role takes the largest.

    prefill   queued prompt tokens per pod (baton_num_queued_tokens)   mean over the window
              TTFT (baton_time_to_first_token_seconds)                   mean of the window's requests
    decode    KV usage (baton_token_usage)                               mean over the window
              ITL (baton_inter_token_latency_seconds)                    mean of the window's tokens
    engine    any of the four (colocated)

The window is the last `window_seconds`, cut where the role's number of Ready pods last changed. A
latency with no request in the window counts as 0 (idle). Then, as the HPA's behavior does it, each
role is stabilised: it goes up to the lowest recommendation of the last `scale_up_seconds` (0: at once)
and down to the highest of the last `scale_down_seconds` (a burst that passes is not worth a pod that
loaded its model for minutes), is held within [min, max], and finally the prefill:decode ratio is kept
within its bounds by raising the side that is short (never by cutting the other).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from baton.operator.naming import Role

TOLERANCE = 0.1  # as the HPA's: within 10% of the target nothing changes


class Metric(NamedTuple):
    key: str  # RoleTargets field and status key
    what: str  # in reasons
    unit: str


QUEUED_TOKENS = Metric("queuedTokens", "queued prompt tokens per pod", "")
TTFT = Metric("ttftSeconds", "mean TTFT", "s")
KV_USAGE = Metric("kvUsage", "KV usage", "")
ITL = Metric("itlSeconds", "mean ITL", "s")
METRICS = (QUEUED_TOKENS, TTFT, KV_USAGE, ITL)


@dataclass(frozen=True)
class RoleTargets:
    """spec.autoscaling.<role>: bounds and the targets set (None: not a signal for this role)."""

    min_replicas: int = 1
    max_replicas: int = 4
    targets: Mapping[str, float] = field(default_factory=dict)  # Metric.key -> target

    def __post_init__(self) -> None:
        assert 0 <= self.min_replicas <= self.max_replicas, "validated before parsing"
        assert all(m in {x.key for x in METRICS} and t > 0 for m, t in self.targets.items())


@dataclass(frozen=True)
class PlannerConfig:
    roles: Mapping[Role, RoleTargets]
    min_ratio: float | None = None  # prefill replicas / decode replicas, at least
    max_ratio: float | None = None  # ... and at most
    interval_seconds: float = 15.0  # between two scrapes
    window_seconds: float = 60.0  # metrics are averaged over this much of the series
    scale_up_seconds: float = 0.0  # stabilisation windows (see the module doc)
    scale_down_seconds: float = 300.0


@dataclass(frozen=True)
class PodSample:
    """One pod's /metrics at one scrape; latency sums and counts are the histograms' running totals."""

    pod: str
    kv_usage: float = 0.0
    queued_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0


@dataclass(frozen=True)
class Sample:
    """One scrape of the Ready pods of one role (those that answered)."""

    at: float
    role: Role
    pods: tuple[PodSample, ...]


class Recommendation(NamedTuple):
    at: float
    role: Role
    replicas: int


@dataclass(frozen=True)
class RolePlan:
    current: int
    replicas: int  # what the role should have now
    reason: str
    observed: dict[str, float]  # Metric.key -> value over the window (what the reason says)


class Plan(NamedTuple):
    roles: dict[Role, RolePlan]
    memory: tuple[Recommendation, ...]  # hand back to the next step


# -- signals ---------------------------------------------------------------------------------
def _window(samples: Iterable[Sample], role: Role, start: float) -> list[Sample]:
    """The role's scrapes since `start` and since its number of pods last changed: a mean taken over
    fewer pods than there are now would ask for them again (and overshoot)."""
    window = [s for s in samples if s.role is role and s.at >= start]
    tail = len(window)
    while tail > 0 and len(window[tail - 1].pods) == len(window[-1].pods):
        tail -= 1
    return window[tail:]


def _gauge_mean(window: Sequence[Sample], attr: str) -> float | None:
    """The mean over the window's scrapes of the mean over that scrape's pods."""
    means = [sum(getattr(p, attr) for p in s.pods) / len(s.pods) for s in window if s.pods]
    return sum(means) / len(means) if means else None


def _latency_mean(window: Sequence[Sample], name: str) -> float | None:
    """Mean latency of what happened between the window's first and last scrape (per pod: the counters'
    increase; a pod that restarted counts from 0). 0 when nothing happened; None with < 2 scrapes or
    when no pod answered (that is not idleness)."""
    if len(window) < 2 or not window[-1].pods:
        return None
    first = {p.pod: p for p in window[0].pods}
    total = count = 0.0
    for p in window[-1].pods:
        s0, c0 = (getattr(first[p.pod], f"{name}_sum"), getattr(first[p.pod], f"{name}_count")) \
            if p.pod in first else (0.0, 0.0)
        s1, c1 = getattr(p, f"{name}_sum"), getattr(p, f"{name}_count")
        if c1 < c0:  # restarted
            s0 = c0 = 0.0
        total, count = total + s1 - s0, count + c1 - c0
    return total / count if count > 0 else 0.0


def observe(window: Sequence[Sample], keys: Iterable[str]) -> dict[str, float]:
    """Each wanted metric over the window (missing where it cannot be told yet)."""
    fns = {QUEUED_TOKENS.key: lambda: _gauge_mean(window, "queued_tokens"),
           KV_USAGE.key: lambda: _gauge_mean(window, "kv_usage"),
           TTFT.key: lambda: _latency_mean(window, "ttft"),
           ITL.key: lambda: _latency_mean(window, "itl")}
    out = {}
    for key in keys:
        value = fns[key]()
        if value is not None:
            out[key] = value
    return out


# -- decisions -------------------------------------------------------------------------------
def proportional(pods: int, observed: float, target: float) -> int:
    """The HPA's rule: as many pods as bring the observed value to the target."""
    ratio = observed / target
    if abs(ratio - 1.0) <= TOLERANCE:
        return pods
    return math.ceil(pods * ratio - 1e-9)


def _describe(metric: Metric, value: float, target: float) -> str:
    cmp = ">" if value > target * (1 + TOLERANCE) else "<" if value < target * (1 - TOLERANCE) else "~"
    return f"{metric.what} {value:.3g}{metric.unit} {cmp} target {target:.3g}{metric.unit}"


def recommend(targets: RoleTargets, pods: int, observed: Mapping[str, float]) -> tuple[int | None, str]:
    """The role's raw recommendation (None: no signal yet) and what drove it."""
    best: tuple[int, str] | None = None
    for metric in METRICS:
        if metric.key in targets.targets and metric.key in observed:
            n = proportional(max(pods, 1), observed[metric.key], targets.targets[metric.key])
            if best is None or n > best[0]:
                best = (n, _describe(metric, observed[metric.key], targets.targets[metric.key]))
    return (None, "no metrics yet") if best is None else best


def stabilise(memory: Sequence[Recommendation], role: Role, current: int, now: float,
              up_seconds: float, down_seconds: float) -> int:
    """Kubernetes' HPA stabilisation: up to the lowest recommendation of the up window, down to the
    highest of the down window (the newest recommendation is in `memory`)."""
    ups = [r.replicas for r in memory if r.role is role and r.at >= now - up_seconds]
    downs = [r.replicas for r in memory if r.role is role and r.at >= now - down_seconds]
    out = current
    if ups and min(ups) > out:
        out = min(ups)
    if downs and max(downs) < out:
        out = max(downs)
    return out


def keep_ratio(prefill: int, decode: int, config: PlannerConfig) -> tuple[int, int, str]:
    """Raise the short side so that min_ratio <= prefill/decode <= max_ratio (as far as max allows)."""
    p_max, d_max = config.roles[Role.PREFILL].max_replicas, config.roles[Role.DECODE].max_replicas
    if config.max_ratio is not None and prefill > decode * config.max_ratio:
        decode = min(d_max, math.ceil(prefill / config.max_ratio - 1e-9))
        return prefill, decode, f"decode raised to keep prefill:decode <= {config.max_ratio:g}"
    if config.min_ratio is not None and prefill < decode * config.min_ratio:
        prefill = min(p_max, math.ceil(decode * config.min_ratio - 1e-9))
        return prefill, decode, f"prefill raised to keep prefill:decode >= {config.min_ratio:g}"
    return prefill, decode, ""


def plan(config: PlannerConfig, samples: Sequence[Sample], replicas: Mapping[Role, int],
         memory: Sequence[Recommendation], now: float) -> Plan:
    """One step. `replicas`: each role's Deployment replicas now; `samples`: the scraped series (older
    ones than the window are ignored); `memory`: what the previous step returned."""
    start = now - config.window_seconds
    horizon = now - max(config.scale_up_seconds, config.scale_down_seconds)
    kept = [r for r in memory if r.at >= horizon]
    roles: dict[Role, RolePlan] = {}
    raw: dict[Role, tuple[int, str, dict[str, float]]] = {}
    for role, targets in config.roles.items():
        window = _window(samples, role, start)
        observed = observe(window, targets.targets)
        pods = len(window[-1].pods) if window else 0
        rec, why = recommend(targets, pods or replicas[role], observed)
        if rec is not None:
            kept.append(Recommendation(now, role, min(max(rec, targets.min_replicas), targets.max_replicas)))
        raw[role] = (rec if rec is not None else replicas[role], why, observed)
    for role, targets in config.roles.items():
        current = replicas[role]
        stable = stabilise(kept, role, current, now, config.scale_up_seconds, config.scale_down_seconds)
        stable = min(max(stable, targets.min_replicas), targets.max_replicas)
        rec, why, observed = raw[role]
        roles[role] = RolePlan(current, stable, _reason(role, current, stable, rec, why, targets, config), observed)
    if Role.PREFILL in roles and Role.DECODE in roles:
        p, d = roles[Role.PREFILL], roles[Role.DECODE]
        np_, nd, why = keep_ratio(p.replicas, d.replicas, config)
        if why:
            roles[Role.PREFILL] = RolePlan(p.current, np_, f"{p.reason}; {why}" if np_ != p.replicas else p.reason,
                                           p.observed)
            roles[Role.DECODE] = RolePlan(d.current, nd, f"{d.reason}; {why}" if nd != d.replicas else d.reason,
                                          d.observed)
    return Plan(roles, tuple(kept))


def _reason(role: Role, current: int, stable: int, rec: int, why: str, targets: RoleTargets,
            config: PlannerConfig) -> str:
    if stable > current:
        return f"{role.value} {current} -> {stable}: {why}"
    if stable < current:
        return f"{role.value} {current} -> {stable}: {why} for {config.scale_down_seconds:g}s"
    stays = f"{role.value} stays at {current}: {why}"
    if rec < current and current > targets.min_replicas:
        return f"{stays}, waiting out the {config.scale_down_seconds:g}s scale-down window"
    if rec > current and current < targets.max_replicas:
        return f"{stays}, waiting out the {config.scale_up_seconds:g}s scale-up window"
    bound = " (its minReplicas)" if rec < current else " (its maxReplicas)" if rec > current else ""
    return f"{role.value} stays at {current}{bound}: {why}"
