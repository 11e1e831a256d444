"""The P:D planner's decisions on recorded metric series: `plan` is a pure function of the series, the
config and the clock, so each test replays a series scrape by scrape, applying each plan as the
autoscaler does, and checks when and why replicas change."""
from __future__ import annotations

from collections.abc import Callable

from baton.operator.naming import Role
from baton.operator.planner import (ITL, KV_USAGE, QUEUED_TOKENS, TTFT, PlannerConfig, PodSample, RoleTargets,
                                    Sample, keep_ratio, plan)

STEP = 15.0  # seconds between scrapes


def config(**kw) -> PlannerConfig:
    roles = kw.pop("roles", None) or {
        Role.PREFILL: RoleTargets(1, 3, {QUEUED_TOKENS.key: 512}),
        Role.DECODE: RoleTargets(1, 4, {KV_USAGE.key: 0.6}),
    }
    return PlannerConfig(roles=roles, interval_seconds=STEP, window_seconds=30, **kw)


def replay(cfg: PlannerConfig, seconds: float, pods_at: Callable[[Role, float, int], tuple[PodSample, ...]],
           start: dict[Role, int] | None = None) -> list[tuple[float, dict[Role, int], dict[Role, str]]]:
    """Scrape every STEP seconds (the pods the role has now), plan, apply. (time, replicas, reasons) per step."""
    replicas = dict(start or {role: 1 for role in cfg.roles})
    samples, memory, out = [], (), []
    t = 0.0
    while t <= seconds:
        samples += [Sample(t, role, pods_at(role, t, replicas[role])) for role in cfg.roles]
        result = plan(cfg, samples, replicas, memory, t)
        memory = result.memory
        replicas = {role: p.replicas for role, p in result.roles.items()}
        out.append((t, dict(replicas), {role: p.reason for role, p in result.roles.items()}))
        t += STEP
    return out


def changes(history, role: Role) -> list[tuple[float, int, str]]:
    out, last = [], 1
    for t, replicas, reasons in history:
        if replicas[role] != last:
            out.append((t, replicas[role], reasons[role]))
            last = replicas[role]
    return out


def decode_load(step_at: float, quiet_at: float, total_usage: float) -> Callable:
    """KV usage a load step puts on the decode pods: `total_usage` of one pod's pool spread over the
    pods there are, from step_at to quiet_at; 5% of one pod before and after."""
    def pods(role: Role, t: float, n: int) -> tuple[PodSample, ...]:
        load = total_usage if step_at <= t < quiet_at else 0.05
        usage = load / n if role is Role.DECODE else 0.0
        return tuple(PodSample(f"{role.value}-{i}", kv_usage=usage) for i in range(n))
    return pods


def test_a_load_step_adds_decode_pods_at_once_and_a_quiet_period_removes_them_after_the_window():
    cfg = config(scale_down_seconds=300)
    history = replay(cfg, 1200, decode_load(step_at=120, quiet_at=480, total_usage=1.5))
    ups_and_downs = changes(history, Role.DECODE)
    (t_up, n_up, why_up), *rest = ups_and_downs
    # the window mixes the last quiet scrape with the first loaded ones: up within two scrapes
    assert 120 <= t_up <= 120 + 2 * STEP and "KV usage" in why_up and "> target 0.6" in why_up
    assert max(n for _, n, _ in ups_and_downs) == 3  # 1.5 of one pool at 0.6 each: 3 pods
    downs = [(t, n, why) for t, n, why in rest if n < 3]
    assert downs and all(t >= 480 + 300 for t, _, _ in downs), downs  # not before the window has passed
    assert downs[-1][1] == 1 and "< target 0.6" in downs[-1][2] and "for 300s" in downs[-1][2]
    counts = [n for _, n, _ in ups_and_downs]
    assert counts == sorted(counts[: counts.index(3) + 1]) + counts[counts.index(3) + 1:]  # up, then down
    assert history[-1][1][Role.PREFILL] == 1  # no queue on the prefill: it stays


def test_a_restarted_operator_takes_back_the_stabilisation_memory_from_the_status():
    """An operator restarted mid-way through the scale-down window (its scraped series lost) takes the
    recommendations back from status.autoscaling: it scales down when one that never restarted does,
    after the window; a fresh memory would scale down at its first quiet scrapes."""
    from baton.operator.autoscaler import PlannerState, planner_status

    cfg = config(scale_down_seconds=300)
    load = decode_load(step_at=120, quiet_at=480, total_usage=1.5)
    straight = changes(replay(cfg, 1200, load), Role.DECODE)

    def restarted(restore: bool) -> list:
        replicas, samples, state, out, t = {Role.PREFILL: 1, Role.DECODE: 1}, [], PlannerState(), [], 0.0
        while t <= 1200:
            if t == 600:  # the operator restarts: what survives is the status it wrote
                state = PlannerState.from_status(status) if restore else PlannerState()
                samples = []
            now = 1.7e9 + t  # wall-clock-like: the status keeps whole seconds since the epoch
            samples += [Sample(now, role, load(role, t, replicas[role])) for role in cfg.roles]
            result = plan(cfg, samples, replicas, state.memory, now)
            state.memory = result.memory
            status = planner_status(result, state, now)
            replicas = {role: p.replicas for role, p in result.roles.items()}
            out.append((t, dict(replicas), {role: p.reason for role, p in result.roles.items()}))
            t += STEP
        return changes(out, Role.DECODE)

    assert [(t, n) for t, n, _ in restarted(restore=True)] == [(t, n) for t, n, _ in straight]
    early = [(t, n) for t, n, _ in restarted(restore=False) if n < 3]
    assert early and early[0][0] < 480 + 300, "without the memory the restart scales down inside the window"


def test_load_that_swings_faster_than_the_down_window_does_not_flap():
    cfg = config(scale_down_seconds=300)

    def swinging(role: Role, t: float, n: int):  # 2 minutes at 1.5 pools, 2 minutes idle, again and again
        busy = (t // 120) % 2 == 1
        usage = (1.5 if busy else 0.02) / n if role is Role.DECODE else 0.0
        return tuple(PodSample(f"{role.value}-{i}", kv_usage=usage) for i in range(n))

    history = replay(cfg, 1800, swinging)
    moves = changes(history, Role.DECODE)
    counts = [n for _, n, _ in moves]
    assert counts == sorted(counts) and counts[-1] == 3 and moves[-1][0] < 300, moves  # up, then held through every lull


def test_prefill_follows_ttft_and_queued_tokens():
    roles = {Role.PREFILL: RoleTargets(1, 3, {TTFT.key: 0.5, QUEUED_TOKENS.key: 4096}),
             Role.DECODE: RoleTargets(1, 4, {ITL.key: 0.05})}
    cfg = config(roles=roles)
    totals = {"n": 0.0, "sum": 0.0}

    def pods(role: Role, t: float, n: int):
        if role is Role.DECODE:  # decodes run at their target ITL: 20 tokens a second each
            return tuple(PodSample(f"d-{i}", itl_sum=t * 20 * 0.05, itl_count=t * 20) for i in range(n))
        if t >= 60:  # from then on 4 requests a scrape at 1.6 s TTFT, queue well under its target
            totals["n"] += 4
            totals["sum"] += 4 * 1.6
        return tuple(PodSample(f"p-{i}", queued_tokens=100.0, ttft_sum=totals["sum"] / n, ttft_count=totals["n"] / n)
                     for i in range(n))

    history = replay(cfg, 300, pods)
    [(t, n, why)] = changes(history, Role.PREFILL)
    assert n == 3 and t <= 60 + 2 * STEP and "mean TTFT 1.6s > target 0.5s" in why  # ceil(1 * 3.2), at max 3
    assert changes(history, Role.DECODE) == []
    assert "stays at 1" in history[-1][2][Role.DECODE] and "mean ITL 0.05s ~ target 0.05s" in history[-1][2][Role.DECODE]


def test_the_prefill_decode_ratio_raises_the_short_side():
    cfg = config(min_ratio=0.5, max_ratio=2.0)
    history = replay(cfg, 120, decode_load(step_at=0, quiet_at=10_000, total_usage=2.3))
    t, replicas, reasons = history[-1]
    assert replicas[Role.DECODE] == 4 and replicas[Role.PREFILL] == 2  # 4 decodes need >= 2 prefills
    assert "prefill raised to keep prefill:decode >= 0.5" in reasons[Role.PREFILL]
    assert keep_ratio(3, 1, cfg) == (3, 2, "decode raised to keep prefill:decode <= 2")
    assert keep_ratio(2, 2, cfg) == (2, 2, "")


def test_pods_without_metrics_and_restarted_counters():
    roles = {Role.PREFILL: RoleTargets(1, 3, {TTFT.key: 1.0}), Role.DECODE: RoleTargets(1, 4, {KV_USAGE.key: 0.6})}
    cfg = config(roles=roles)
    first = plan(cfg, [], {Role.PREFILL: 1, Role.DECODE: 2}, (), 0.0)
    assert {r: p.replicas for r, p in first.roles.items()} == {Role.PREFILL: 1, Role.DECODE: 2}
    assert "no metrics yet" in first.roles[Role.DECODE].reason
    # a prefill pod restarted between the scrapes (its counters went back): its new totals count
    samples = [Sample(0, Role.PREFILL, (PodSample("p", ttft_sum=500.0, ttft_count=1000),)),
               Sample(15, Role.PREFILL, (PodSample("p", ttft_sum=6.0, ttft_count=2),))]
    result = plan(cfg, samples, {Role.PREFILL: 1, Role.DECODE: 1}, (), 15.0)
    assert result.roles[Role.PREFILL].observed[TTFT.key] == 3.0 and result.roles[Role.PREFILL].replicas == 3
    # no pod answered the last scrapes (the operator's network, pods restarting): no decision, not "idle"
    silent = [Sample(t, Role.PREFILL, ()) for t in (30.0, 45.0)]
    result = plan(cfg, samples + silent, {Role.PREFILL: 3, Role.DECODE: 1}, result.memory, 45.0)
    assert result.roles[Role.PREFILL].replicas == 3 and "no metrics yet" in result.roles[Role.PREFILL].reason


def test_the_engines_metrics_parse_into_a_sample():
    """What the planner reads is what an engine serves: EngineMetrics' own exposition (two DP ranks)."""
    from prometheus_client import generate_latest

    from baton.engine.metrics import EngineMetrics
    from baton.operator.scrape import parse_metrics

    metrics = EngineMetrics("m", "decode")
    metrics.update_from_server_infos([{"dp_rank": 0, "token_usage": 0.5, "num_waiting_tokens": 30},
                                      {"dp_rank": 1, "token_usage": 0.25, "num_waiting_tokens": 12}])
    for seconds in (0.5, 1.5):
        metrics.ttft.observe(seconds)
    metrics.itl.observe(0.02)
    sample = parse_metrics("pod-a", generate_latest(metrics.registry).decode())
    assert sample == PodSample("pod-a", kv_usage=0.375, queued_tokens=42.0, ttft_sum=2.0, ttft_count=2.0,
                               itl_sum=0.02, itl_count=1.0)
