"""One reconcile of an InferenceService: parse, build, apply children, prune leftovers, publish status.

kopf-free (the handlers translate errors into kopf's), so it runs the same from a create/update/resume
handler, the periodic resync daemon and child Deployment events.
"""
from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from baton.operator import naming
from baton.operator.apply import Outcome, apply, controlled_by, prune
from baton.operator.builders import build_children
from baton.operator.builders.internal_key import internal_key_secret
from baton.operator.inplace import WeightsState, weights_step
from baton.operator.kube import KINDS, ApiError, KubeClient
from baton.operator.naming import Role
from baton.operator.spec import InferenceService, InvalidSpec, parse
from baton.operator.status import RECONCILED, STATUS_KEYS, compute_status, invalid_status

MONITORING_KINDS = ("PodMonitor", "ServiceMonitor")


@dataclass
class ReconcileResult:
    isvc: InferenceService
    outcomes: dict[str, Outcome] = field(default_factory=dict)  # "Kind/name" -> outcome
    pruned: list[str] = field(default_factory=list)
    problem: tuple[str, str] | None = None
    switching: str | None = None  # a mode switch waiting for its new engine pods (what it waits for)
    weights: WeightsState | None = None  # spec.model.updateStrategy InPlace: where the update stands

    @property
    def kinds(self) -> list[str]:
        return [key.split("/", 1)[0] for key in self.outcomes]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _all_children(name: str) -> list[tuple[str, str]]:
    """Every (kind, name) any spec of this InferenceService may create, to prune the unwanted."""
    out = [("Deployment", naming.child_name(name, r)) for r in Role]
    out += [("Service", naming.child_name(name, r)) for r in Role]
    out += [("PodDisruptionBudget", naming.child_name(name, r)) for r in Role]
    out += [(k, name) for k in MONITORING_KINDS]
    out.append(("NetworkPolicy", naming.engine_network_policy(name)))
    return out


def rolled_out(dep: Mapping[str, Any] | None) -> bool:
    """A Deployment whose pods all run its current template and are Ready."""
    if dep is None:
        return False
    want, st = dep.get("spec", {}).get("replicas", 1), dep.get("status") or {}
    return (st.get("observedGeneration", 0) >= dep["metadata"].get("generation", 1)
            and st.get("updatedReplicas", 0) >= want and st.get("readyReplicas", 0) >= want)


async def _mode_switch(client: KubeClient, isvc: InferenceService) -> tuple[bool, bool]:
    """(switching, hold): engine Deployments of the other mode are still there; `hold` while the new
    mode's engine Deployments are not all Ready: the router keeps its old args (and pods) and the old
    roles stay, so the service answers through the switch."""
    kind = KINDS["Deployment"]
    old = [r for r in naming.ENGINE_ROLES if r not in isvc.spec.roles]
    live = [await client.get(kind, isvc.namespace, naming.child_name(isvc.name, r)) for r in old]
    if not any(d is not None and controlled_by(d, isvc.uid) for d in live):
        return False, False
    new = [await client.get(kind, isvc.namespace, naming.child_name(isvc.name, r)) for r in isvc.spec.roles]
    return True, not all(rolled_out(d) for d in new)


async def ensure_internal_key(client: KubeClient, isvc: InferenceService) -> Outcome:
    """Create the service's internal key Secret if it is not there; never rewrite it. The operator may
    create Secrets but not read them, so one that exists (409) is the one it made: its name carries the
    service's uid. The key goes to the API server only, never to a log."""
    try:
        await client.create(internal_key_secret(isvc, secrets.token_urlsafe(32)))
    except ApiError as e:
        if e.status != 409:
            raise
        return Outcome.UNCHANGED
    return Outcome.CREATED


async def switch_pending(client: KubeClient, body: Mapping[str, Any]) -> bool:
    """A mode switch is under way (engine Deployments of the other mode are left): each child Deployment
    event re-runs the reconcile, which takes its next step."""
    try:
        isvc = parse(body)
    except InvalidSpec:
        return False
    return (await _mode_switch(client, isvc))[0]


async def reconcile(client: KubeClient, body: Mapping[str, Any],
                    operator_namespace: str | None = None) -> ReconcileResult:
    """Apply the children of `body`'s spec. Raises InvalidSpec, ApiError, NotOwned. `operator_namespace`:
    where the operator's pod runs (the engines' NetworkPolicy lets it scrape them for the planner).

    A `mode` switch goes in three steps, one per reconcile (child Deployment events re-run it): the new
    engine roles are created while the router and the old roles stay; once they are Ready the router gets
    its new args; once the router has rolled out the old roles are pruned."""
    isvc = parse(body)
    result = ReconcileResult(isvc)
    desired = build_children(isvc, operator_namespace)
    switching, hold = await _mode_switch(client, isvc)
    router_name = naming.child_name(isvc.name, Role.ROUTER)
    if hold:
        result.switching = f"the new {' and '.join(r.suffix for r in isvc.spec.roles)} pods are Ready"
        desired = [o for o in desired if not (o["kind"] == "Deployment" and o["metadata"]["name"] == router_name)]
    elif switching:
        live = await client.get(KINDS["Deployment"], isvc.namespace, router_name)
        [want] = [o for o in desired if o["kind"] == "Deployment" and o["metadata"]["name"] == router_name]
        if live is None or _hash(live) != _hash(want) or not rolled_out(live):  # patched now, or rolling
            result.switching = "the router has rolled out to the new roles"
    secret = f"Secret/{naming.internal_key_secret(isvc.name, isvc.uid)}"
    result.outcomes[secret] = await ensure_internal_key(client, isvc)  # before the pods that read it
    result.weights = await weights_step(client, isvc)  # the model ConfigMap too is read by the pods
    missing_monitoring = []
    for obj in desired:
        key = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            result.outcomes[key] = await apply(client, obj, isvc.uid)
        except ApiError as e:
            if obj["kind"] in MONITORING_KINDS and e.status == 404:
                missing_monitoring.append(obj["kind"])
                continue
            raise
    if missing_monitoring:
        kinds = " and ".join(missing_monitoring)
        result.problem = ("MonitoringUnavailable",
                          f"{kinds} cannot be created: the Prometheus Operator CRDs (monitoring.coreos.com) "
                          "are not installed. Install them, or turn off spec.monitoring.podMonitor/serviceMonitor.")
    wanted = {(o["kind"], o["metadata"]["name"]) for o in build_children(isvc, operator_namespace)}
    for kind, name in _all_children(isvc.name):
        if result.switching and kind != "PodMonitor" and kind != "ServiceMonitor":
            continue  # the old roles serve until the switch is done
        if (kind, name) not in wanted and await prune(client, kind, isvc.namespace, name, isvc.uid):
            result.pruned.append(f"{kind}/{name}")
    return result


def _hash(obj: Mapping[str, Any]) -> str | None:
    return (obj.get("metadata", {}).get("annotations") or {}).get(naming.SPEC_HASH_ANNOTATION)


async def fetch_deployments(client: KubeClient, isvc: InferenceService) -> dict[Role, dict[str, Any] | None]:
    """The spec's roles' Deployments and the router's, and, during a mode switch, the other mode's
    engine Deployments this service still owns (they serve until the switch is done)."""
    kind = KINDS["Deployment"]
    out = {r: await client.get(kind, isvc.namespace, naming.child_name(isvc.name, r))
           for r in [*isvc.spec.roles, Role.ROUTER]}
    for r in naming.ENGINE_ROLES:
        if r not in out and (d := await client.get(kind, isvc.namespace, naming.child_name(isvc.name, r))) is not None \
                and controlled_by(d, isvc.uid):
            out[r] = d
    return out


async def fetch_router_service(client: KubeClient, isvc: InferenceService) -> dict[str, Any] | None:
    """The live router Service when it is a LoadBalancer (its address is in its status), else None."""
    if isvc.spec.router.service_type != "LoadBalancer":
        return None
    return await client.get(KINDS["Service"], isvc.namespace, naming.child_name(isvc.name, Role.ROUTER))


async def fetch_pods(client: KubeClient, isvc: InferenceService) -> list[dict[str, Any]]:
    """The service's pods (for the scheduler's verdicts); none when they cannot be read: the status
    then says only what the Deployments say."""
    try:
        return await client.list(KINDS["Pod"], isvc.namespace, {naming.SERVICE_LABEL: isvc.name})
    except ApiError:
        return []


def _kept_problem(status: Mapping[str, Any]) -> tuple[str, str] | None:
    """The problem the last reconcile found (its `Reconciled` condition), for status-only refreshes."""
    for c in status.get("conditions", []):
        if c.get("type") == RECONCILED and c.get("status") == "False":
            return c.get("reason", ""), c.get("message", "")
    return None


async def publish(client: KubeClient, body: Mapping[str, Any], new: dict[str, Any]) -> bool:
    """Merge-patch `.status` to `new` (role keys of the other mode removed); False if already so."""
    old = body.get("status") or {}
    full = {**{k: None for k in STATUS_KEYS.values()}, **new}
    if all(old.get(k) == v for k, v in full.items()):
        return False
    meta = body["metadata"]
    await client.patch(KINDS[naming.KIND], meta["namespace"], meta["name"], {"status": full}, sub="status")
    return True


async def refresh_status(client: KubeClient, body: Mapping[str, Any], result: ReconcileResult | None = None,
                         failed: tuple[str, str] | None = None) -> dict[str, Any] | None:
    """Recompute the status from the child Deployments and their pods and publish it. None for an
    invalid spec (its InvalidSpec status stays until the spec is fixed).

    After a reconcile: its `result`, or the (reason, message) that made it `failed` (ApiRefused,
    NameTaken). Neither: a refresh on a Deployment event, which keeps the last reconcile's problem."""
    previous = body.get("status") or {}
    try:
        isvc = result.isvc if result else parse(body)
    except InvalidSpec:
        return None
    if result is not None:  # the children of this generation were just applied
        observed, problem = isvc.generation, result.problem
    else:
        observed = previous.get("observedGeneration", 0)
        problem = failed or _kept_problem(previous)
    status = compute_status(isvc, await fetch_deployments(client, isvc), previous, now(), observed, problem,
                            pods=await fetch_pods(client, isvc),
                            router_service=await fetch_router_service(client, isvc),
                            switching=result.switching if result else None,
                            weights=result.weights if result else None)
    await publish(client, body, status)
    return status


async def publish_invalid(client: KubeClient, body: Mapping[str, Any], errors: list[str]) -> dict[str, Any]:
    status = invalid_status(body.get("status") or {}, errors, body["metadata"].get("generation", 1), now())
    await publish(client, body, status)
    return status


def api_refused_message(e: ApiError) -> str:
    return (f"the API server refused a child object ({e.status} {e.reason}: {e.message}); "
            "fix the fields copied from the spec (resources, env, tolerations, affinity, nodeSelector, "
            "networkPolicy.metricsFrom)")
