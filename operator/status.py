"""InferenceService status from its child Deployments and their pods (pure: the caller fetches).

Ready means a request can be served: at least one ready router pod (its readiness is `/health`) and at
least one ready pod of every engine role; during a mode switch, of every role of either mode (the old
roles serve until the new ones are Ready and the router has moved to them). Every condition that is not as it should be says what to do.
Pods the scheduler cannot place (`PodScheduled=False`, e.g. `Insufficient nvidia.com/gpu`) say so: a
Deployment only notices them when its progress deadline (30 min for engines) runs out.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from baton.operator import naming
from baton.operator.naming import Role
from baton.operator.spec import InferenceService

CONDITION_TYPES = {Role.PREFILL: "PrefillReady", Role.DECODE: "DecodeReady",
                   Role.COLOCATED: "EngineReady", Role.ROUTER: "RouterReady"}
WEIGHTS_UPDATED = "WeightsUpdated"  # spec.model.updateStrategy InPlace (baton.operator.inplace)
STATUS_KEYS = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.COLOCATED: "engine", Role.ROUTER: "router"}
# Problems the reconciler finds while applying (Deployments do not show them). The `Reconciled`
# condition carries them, so a status refresh from Deployment events keeps them.
BLOCKING_PROBLEMS = ("ApiRefused", "NameTaken")  # the latest spec is not applied
RECONCILED = "Reconciled"
PENDING = "<pending>"  # a LoadBalancer without an address yet, as `kubectl get services` says it


@dataclass(frozen=True)
class RoleState:
    role: Role
    desired: int
    ready: int
    updated: int
    available: int
    rolled_out: bool  # the Deployment's controller has caught up and no old pods remain
    failure: tuple[str, str] | None  # (reason, message) from the Deployment's conditions
    exists: bool
    unscheduled: int = 0  # pods the scheduler cannot place
    unscheduled_reason: tuple[str, str] | None = None  # (reason, message) of the first of them

    def as_status(self) -> dict[str, Any]:
        return {"desiredReplicas": self.desired, "readyReplicas": self.ready,
                "updatedReplicas": self.updated, "availableReplicas": self.available,
                "summary": f"{self.ready}/{self.desired}"}


def role_state(role: Role, desired: int, deployment: Mapping[str, Any] | None,
               pods: Sequence[Mapping[str, Any]] = ()) -> RoleState:
    """`pods`: this role's pods (any of them; others are ignored by the caller's selector)."""
    unscheduled = [c for c in map(_unscheduled, pods) if c is not None]
    first = unscheduled[0] if unscheduled else None
    if deployment is None:
        return RoleState(role, desired, 0, 0, 0, False, None, False, len(unscheduled), first)
    st = deployment.get("status") or {}
    generation = deployment.get("metadata", {}).get("generation", 0)
    desired = deployment.get("spec", {}).get("replicas", desired)
    ready, updated = st.get("readyReplicas", 0), st.get("updatedReplicas", 0)
    current = st.get("observedGeneration", 0) >= generation
    rolled_out = current and updated == desired and st.get("replicas", 0) == desired and ready == desired
    failure = None
    for c in st.get("conditions", []):
        if c.get("type") == "ReplicaFailure" and c.get("status") == "True":
            failure = ("ReplicaFailure", c.get("message", ""))
        elif c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded":
            failure = ("ProgressDeadlineExceeded", c.get("message", ""))
    return RoleState(role, desired, ready, updated, st.get("availableReplicas", 0), rolled_out, failure, True,
                     len(unscheduled), first)


def _unscheduled(pod: Mapping[str, Any]) -> tuple[str, str] | None:
    """(reason, message) of a live pod's `PodScheduled=False` condition, e.g. ("Unschedulable",
    "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")."""
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return None
    for c in (pod.get("status") or {}).get("conditions", []):
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("reason") or "Unschedulable", c.get("message", "").strip()
    return None


def _unscheduled_message(s: RoleState) -> str:
    assert s.unscheduled_reason is not None
    pods = f"{s.unscheduled} {s.role.suffix} pod{'s' if s.unscheduled > 1 else ''}"
    return f"{pods} cannot be scheduled: {s.unscheduled_reason[1].rstrip('.')}"


def _selector(isvc: InferenceService, role: Role) -> str:
    return ",".join(f"{k}={v}" for k, v in naming.selector_labels(isvc.name, role).items())


def _pods_hint(isvc: InferenceService, role: Role) -> str:
    sel = _selector(isvc, role)
    return f"`kubectl -n {isvc.namespace} describe pods -l {sel}` and `kubectl logs -l {sel}`"


def _role_condition(isvc: InferenceService, s: RoleState) -> tuple[bool, str, str]:
    what = f"{s.role.suffix} pods"
    if not s.exists:
        return False, "DeploymentMissing", (f"Deployment {naming.child_name(isvc.name, s.role)} does "
                                            "not exist yet; the operator creates it on its next reconcile.")
    if s.desired == 0:
        return False, "ScaledToZero", f"replicas is 0 for {what}: set it to at least 1 to serve."
    if s.unscheduled_reason is not None and s.ready < s.desired:
        return False, s.unscheduled_reason[0], (
            f"{s.ready}/{s.desired} {what} ready; {_unscheduled_message(s)}. Free or add nodes with what the "
            f"pods request, or lower gpus/replicas or fix nodeSelector/tolerations/affinity in "
            f"spec.{s.role.spec_key}; the scheduler's events: `kubectl -n {isvc.namespace} describe pods -l "
            f"{_selector(isvc, s.role)}`.")
    if s.failure is not None:
        reason, msg = s.failure
        return False, reason, (f"{s.ready}/{s.desired} {what} ready: {msg} Check {_pods_hint(isvc, s.role)}"
                               " (image, GPU/RDMA resources, model path).")
    if s.ready < s.desired:
        return False, "PodsNotReady", (f"{s.ready}/{s.desired} {what} ready; pods turn ready when /health "
                                       f"answers (loading the model can take minutes). If this lasts, "
                                       f"check {_pods_hint(isvc, s.role)}.")
    return True, "AllReady", f"{s.ready}/{s.desired} {what} ready."


def condition(ctype: str, ok: bool, reason: str, message: str, generation: int,
              previous: Sequence[Mapping[str, Any]], now: str) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == ctype), None)
    since = before.get("lastTransitionTime", now) if before and before.get("status") == status else now
    return {"type": ctype, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": since, "observedGeneration": generation}


def client_endpoint(isvc: InferenceService, router_service: Mapping[str, Any] | None, in_cluster: str) -> str:
    """Where clients reach the router: a LoadBalancer Service's address (status.loadBalancer.ingress)
    once it has one, else PENDING; the in-cluster URL for ClusterIP and NodePort."""
    if isvc.spec.router.service_type != "LoadBalancer":
        return in_cluster
    for entry in ((router_service or {}).get("status") or {}).get("loadBalancer", {}).get("ingress") or []:
        host = entry.get("ip") or entry.get("hostname")
        if host:
            return f"http://{f'[{host}]' if ':' in host else host}:{isvc.spec.router.service_port}"
    return PENDING


def _ready(isvc: InferenceService, states: list[RoleState], endpoint: str,
           problem: tuple[str, str] | None, old: Sequence[RoleState] = ()) -> tuple[bool, str, str]:
    """`old`: the other mode's engine roles while a mode switch keeps them."""
    if problem is not None and problem[0] == "ApiRefused":
        return False, *problem
    missing = [s for s in states if s.ready == 0]
    router = [s for s in states if s.role == Role.ROUTER]
    if missing and old and all(s.role != Role.ROUTER for s in missing) and all(s.ready > 0 for s in old + router):
        roles = ", ".join(s.role.suffix for s in old)
        return True, "Serving", (f"serving model {isvc.spec.model.name!r} at {endpoint} through the {roles} pods "
                                 f"of the previous mode while switching to mode {isvc.spec.mode.value}.")
    if missing:
        roles = ", ".join(s.role.suffix for s in missing)
        see = f"see the {', '.join(CONDITION_TYPES[s.role] for s in missing)} condition."
        stuck = [s for s in missing if s.unscheduled_reason is not None]
        if stuck:
            return False, stuck[0].unscheduled_reason[0], (
                f"no ready {roles} pod, so the router cannot serve yet: "
                f"{'; '.join(_unscheduled_message(s) for s in stuck)}; {see}")
        return False, "NotServing", f"no ready {roles} pod, so the router cannot serve yet; {see}"
    partial = [f"{s.ready}/{s.desired} {s.role.suffix}" for s in states if s.ready < s.desired]
    extra = f" with reduced capacity ({', '.join(partial)} pods ready)" if partial else ""
    return True, "Serving", f"serving model {isvc.spec.model.name!r} at {endpoint}{extra}."


def _where(endpoint: str, in_cluster: str) -> str:
    """The Ready message's address: the pending load balancer said, the in-cluster URL given."""
    return f"{in_cluster} (the load balancer has no address yet)" if endpoint == PENDING else endpoint


def _progressing(states: list[RoleState], spec_applied: bool,
                 problem: tuple[str, str] | None) -> tuple[bool, str, str]:
    stuck = [s for s in states if s.failure and s.failure[0] == "ProgressDeadlineExceeded"]
    if stuck:
        return False, "ProgressDeadlineExceeded", (f"{', '.join(s.role.suffix for s in stuck)} did not "
                                                   "finish rolling out in time; see the role conditions.")
    if problem is not None and problem[0] in BLOCKING_PROBLEMS:
        return False, problem[0], "the latest spec cannot be applied; see the Degraded condition."
    unplaced = [s for s in states if s.unscheduled_reason is not None and s.ready < s.desired]
    if unplaced:
        return False, unplaced[0].unscheduled_reason[0], (
            f"waiting for the scheduler: {'; '.join(_unscheduled_message(s) for s in unplaced)}; "
            "see the role conditions.")
    if not spec_applied:
        return True, "Reconciling", "the operator is applying the latest spec."
    rolling = [f"{s.role.suffix} ({s.updated}/{s.desired} updated, {s.ready} ready)"
               for s in states if not s.rolled_out]
    if rolling:
        return True, "RollingOut", f"rolling out {', '.join(rolling)}."
    return False, "RolloutComplete", "all pods run the current spec."


def _degraded(isvc: InferenceService, states: list[RoleState], problem: tuple[str, str] | None,
              model: tuple[bool, str, str] | None = None) -> tuple[bool, str, str]:
    """Every problem in the message; the reason of the first: a spec that cannot be applied, then
    failing pods (not created, not scheduled, a rollout past its deadline), then what only a part of
    the service misses (monitoring)."""
    found = [(model[1], f"{model[2]} (see the {MODEL_READY} condition)")] if model and model[1] == "FetchFailed" else []
    found += [(s.failure[0], f"{s.role.suffix}: {s.failure[1]} Check {_pods_hint(isvc, s.role)}.")
              for s in states if s.failure and s.failure[0] == "ReplicaFailure"]
    found += [(s.unscheduled_reason[0], f"{_unscheduled_message(s)}. See the {CONDITION_TYPES[s.role]} condition.")
              for s in states if s.unscheduled_reason is not None and s.ready < s.desired]
    found += [(s.failure[0], f"{s.role.suffix}: {s.failure[1]} Check {_pods_hint(isvc, s.role)}.")
              for s in states if s.failure and s.failure[0] != "ReplicaFailure"]
    if problem is not None:
        found.insert(0 if problem[0] in BLOCKING_PROBLEMS else len(found), problem)
    if not found:
        return False, "AsExpected", "nothing is degraded."
    return True, found[0][0], " Also: ".join(msg for _, msg in found)


def _reconciled(isvc: InferenceService, problem: tuple[str, str] | None) -> tuple[bool, str, str]:
    if problem is not None:
        return False, *problem
    return True, "Applied", "every child object of the spec is applied."


MODEL_READY = "ModelReady"


def _fetch_state(pod: Mapping[str, Any]) -> tuple[str, str]:
    """(state, detail) of a pod's fetch-model init container: done, failed, fetching or waiting."""
    for s in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if s.get("name") != naming.FETCH_CONTAINER:
            continue
        state, last = s.get("state") or {}, (s.get("lastState") or {}).get("terminated")
        ended = state.get("terminated")
        if ended is not None and ended.get("exitCode") == 0:
            return "done", ""
        failed = ended if ended is not None else last
        why = failed and ((failed.get("message") or "").strip() or f"exit code {failed.get('exitCode')}"
                          f" ({failed.get('reason', 'Error')})")
        if ended is not None or ("waiting" in state and failed):  # failed, or waiting to retry (CrashLoopBackOff)
            return "failed", why or ""
        if "running" in state:
            return "fetching", f"the last try failed: {why}" if why else ""
        return "waiting", (state.get("waiting") or {}).get("reason", "")
    return "waiting", ""


def _model_condition(isvc: InferenceService, pods: Sequence[Mapping[str, Any]]) -> tuple[bool, str, str]:
    """Whether the engine pods' init containers fetched the model: the first failure's reason (what
    `baton fetch-model` wrote to its termination message), else how many pods still fetch."""
    m = isvc.spec.model
    assert m.source is not None
    where = f"the cache (PVC {m.cache_claim})" if m.cache_claim else "each pod's cache (emptyDir)"
    live = [p for r in isvc.spec.roles for p in _pods_of(isvc, r, pods)
            if not p.get("metadata", {}).get("deletionTimestamp")]
    states = [(p.get("metadata", {}).get("name", "?"), *_fetch_state(p)) for p in live]
    logs = f"`kubectl -n {isvc.namespace} logs POD -c {naming.FETCH_CONTAINER}`"
    failed = [(name, why) for name, state, why in states if state == "failed"]
    if failed:
        name, why = failed[0]
        return False, "FetchFailed", (f"fetching {m.source.uri} failed in {len(failed)} pod(s), e.g. {name}: "
                                      f"{why} Fix spec.model.source/fetch (or the Secret, the endpoint) and the pods "
                                      f"retry; see {logs.replace('POD', name)}.")
    fetching = [(name, why) for name, state, why in states if state == "fetching"]
    if fetching:
        note = next((f" ({why})" for _, why in fetching if why), "")
        return False, "Fetching", (f"{len(fetching)} pod(s) fetching {m.source.uri} into {where}{note}; "
                                   f"progress: {logs.replace('POD', fetching[0][0])}.")
    if not states or any(state == "waiting" for _, state, _ in states):
        return False, "Pending", f"waiting for engine pods to start fetching {m.source.uri} into {where}."
    return True, "Fetched", f"{m.source.uri} is in {where}; engines start from {m.path}."


def _pods_of(isvc: InferenceService, role: Role, pods: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    want = naming.selector_labels(isvc.name, role).items()
    return [p for p in pods if want <= (p.get("metadata", {}).get("labels") or {}).items()]


def compute_status(isvc: InferenceService, deployments: Mapping[Role, Mapping[str, Any] | None],
                   previous: Mapping[str, Any], now: str, observed_generation: int,
                   problem: tuple[str, str] | None = None,
                   pods: Sequence[Mapping[str, Any]] = (),
                   router_service: Mapping[str, Any] | None = None,
                   switching: str | None = None, weights: Any = None) -> dict[str, Any]:
    """The whole `.status` (minus nothing): roles, conditions, endpoints.

    `pods`: the service's pods (others are ignored), for what the Deployments do not say: pods
    the scheduler cannot place. `router_service`: the live router Service, for a LoadBalancer's address.

    `weights`: the in-place weight update's state (baton.operator.inplace.WeightsState) after a reconcile;
    None on a status-only refresh, which keeps the last one's WeightsUpdated condition and status.model.
    `switching`: a mode switch under way waits for this (the reconciler says; Progressing says it).
    `problem` is a (reason, message) the reconciler found besides the Deployments, kept in the
    `Reconciled` condition: missing Prometheus Operator CRDs (Degraded, still Ready), a child name taken
    (Degraded, not Progressing), a child the API server refused (Degraded, not Progressing, not Ready).
    """
    from baton.operator.builders import endpoint_url  # builders import spec; keep status light

    roles = [*isvc.spec.roles, Role.ROUTER]
    desired = {**{r: s.replicas for r, s in isvc.spec.roles.items()}, Role.ROUTER: isvc.spec.router.replicas}
    states = [role_state(r, desired[r], deployments.get(r), _pods_of(isvc, r, pods)) for r in roles]
    old = [role_state(r, (d.get("spec") or {}).get("replicas", 1), d, _pods_of(isvc, r, pods))
           for r, d in deployments.items() if r not in roles and d is not None]
    in_cluster = endpoint_url(isvc)
    endpoint = client_endpoint(isvc, router_service, in_cluster)
    prev = previous.get("conditions", [])
    gen = observed_generation
    conds = [condition(CONDITION_TYPES[s.role], *_role_condition(isvc, s), gen, prev, now) for s in states]
    conds.insert(0, condition("Ready", *_ready(isvc, states, _where(endpoint, in_cluster), problem, old),
                              gen, prev, now))
    progressing = _progressing(states, observed_generation >= isvc.generation, problem)
    if switching and progressing[1] in ("Reconciling", "RollingOut", "RolloutComplete"):
        progressing = (True, "SwitchingMode", f"switching to mode {isvc.spec.mode.value}: the old engine roles "
                                              f"and the router serve until {switching}.")
    conds.append(condition("Progressing", *progressing, gen, prev, now))
    model = _model_condition(isvc, pods) if isvc.spec.model.fetched else None
    conds.append(condition("Degraded", *_degraded(isvc, states, problem, model), gen, prev, now))
    conds.append(condition(RECONCILED, *_reconciled(isvc, problem), gen, prev, now))
    if model is not None:
        conds.append(condition(MODEL_READY, *model, gen, prev, now))
    status: dict[str, Any] = {"observedGeneration": observed_generation, "mode": isvc.spec.mode.value,
                              "endpoint": endpoint, "clusterEndpoint": in_cluster, "conditions": conds}
    for s in states:
        status[STATUS_KEYS[s.role]] = s.as_status()
    _weights_status(isvc, weights, previous, status, gen, now)
    return status


def _weights_status(isvc: InferenceService, weights: Any, previous: Mapping[str, Any], status: dict[str, Any],
                    gen: int, now: str) -> None:
    """The WeightsUpdated condition and status.model of an InPlace spec (none otherwise)."""
    if not isvc.spec.model.in_place:
        status["model"] = None
        return
    prev = previous.get("conditions", [])
    if weights is None:  # a refresh between reconciles: what the last one found
        kept = next((c for c in prev if c.get("type") == WEIGHTS_UPDATED), None)
        if kept is not None:
            status["conditions"].append(kept)
        if previous.get("model") is not None:
            status["model"] = previous["model"]
        return
    status["conditions"].append(condition(WEIGHTS_UPDATED, weights.ok, weights.reason, weights.message,
                                          gen, prev, now))
    status["model"] = {"source": weights.source, "weightVersion": weights.weight_version}


def invalid_status(previous: Mapping[str, Any], errors: list[str], generation: int, now: str) -> dict[str, Any]:
    """Status of a spec the operator refuses: Ready=False and Degraded=True, reason InvalidSpec."""
    message = "the spec is invalid, fix it and apply again: " + "; ".join(errors)
    prev = previous.get("conditions", [])
    keep = [c for c in prev if c.get("type") not in ("Ready", "Degraded", "Progressing", RECONCILED)]
    return {"observedGeneration": generation, "conditions": [
        condition("Ready", False, "InvalidSpec", message, generation, prev, now), *keep,
        condition("Progressing", False, "InvalidSpec", "nothing is rolled out until the spec is fixed.",
                  generation, prev, now),
        condition("Degraded", True, "InvalidSpec", message, generation, prev, now),
        condition(RECONCILED, False, "InvalidSpec", message, generation, prev, now)]}
