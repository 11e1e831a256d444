"""kopf handlers, in lifecycle order: startup, login, create/update/resume, resync, child events,
delete, cleanup. The work is in `baton.operator.reconciler`; here errors become kopf's:

- InvalidSpec, or the API server refusing a child (400/422): the user must change the spec, so
  `kopf.PermanentError` (no retries until the next spec change) after a status condition saying what.
- Conflicts, throttling, 5xx, network trouble, missing RBAC (403), a child name taken by a foreign
  object: things that pass or that an admin fixes without a spec change, so `kopf.TemporaryError`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import kopf

from baton.operator import naming
from baton.operator.apply import NotOwned, Outcome, PredecessorLeft, drift, keep_live_replicas
from baton.operator.autoscaler import PlannerState, planner_step
from baton.operator.builders import build_children
from baton.operator.config import OperatorConfig
from baton.operator.kube import KINDS, ApiError, KubeClient, login
from baton.operator.metrics import OperatorMetrics
from baton.operator.reconciler import (api_refused_message, publish_invalid, reconcile, refresh_status,
                                       switch_pending)
from baton.operator.spec import InvalidSpec, parse

RESOURCE = (naming.GROUP, naming.VERSION, naming.PLURAL)
CHILD_LABELS = {naming.MANAGED_BY_LABEL: naming.OPERATOR_NAME}


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    config: OperatorConfig = memo.setdefault("config", OperatorConfig())
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=naming.KOPF_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.KOPF_PREFIX, key="last-handled-configuration")
    settings.persistence.finalizer = f"{naming.GROUP}/finalizer"
    settings.posting.enabled = config.post_events
    settings.posting.loggers = config.post_events  # kopf >= 1.45 posts no handler log line by default
    settings.watching.server_timeout = 300
    memo.setdefault("client", KubeClient())
    memo.setdefault("metrics", OperatorMetrics())
    memo.setdefault("locks", {})
    if config.metrics_port is not None:
        memo.metrics_server = memo.metrics.serve(config.metrics_port, config.metrics_addr)
        logger.info(f"metrics on :{memo.metrics_server.server_port}/metrics")


@kopf.on.login()
def authenticate(logger: logging.Logger, **_: Any) -> kopf.ConnectionInfo:
    return login(logger)


def _lock(memo: kopf.Memo, key: tuple[str, str]) -> asyncio.Lock:
    return memo.locks.setdefault(key, asyncio.Lock())


async def run_reconcile(body: Mapping[str, Any], memo: kopf.Memo, logger: logging.Logger, trigger: str) -> None:
    """Reconcile + status, with kopf errors and metrics. Serialised per InferenceService."""
    client, metrics, config = memo.client, memo.metrics, memo.config
    key = (body["metadata"]["namespace"], body["metadata"]["name"])
    async with _lock(memo, key):
        try:
            with metrics.duration.labels(trigger=trigger).time():
                result = await reconcile(client, body, config.operator_namespace)
                status = await refresh_status(client, body, result)
        except InvalidSpec as e:
            metrics.errors.labels(kind="invalid_spec").inc()
            metrics.reconciles.labels(trigger=trigger, result="invalid").inc()
            await publish_invalid(client, body, e.errors)
            metrics.set_ready(key, "False")
            raise kopf.PermanentError(f"invalid spec: {e}") from e
        except NotOwned as e:
            metrics.errors.labels(kind="name_taken").inc()
            metrics.reconciles.labels(trigger=trigger, result="error").inc()
            await refresh_status(client, body, failed=("NameTaken", str(e)))
            raise kopf.TemporaryError(str(e), delay=config.retry_seconds * 6) from e
        except PredecessorLeft as e:
            metrics.errors.labels(kind="temporary").inc()
            metrics.reconciles.labels(trigger=trigger, result="error").inc()
            raise kopf.TemporaryError(str(e), delay=min(config.retry_seconds, 2.0)) from e
        except ApiError as e:
            metrics.reconciles.labels(trigger=trigger, result="error").inc()
            if e.status in (400, 422):
                metrics.errors.labels(kind="permanent").inc()
                await refresh_status(client, body, failed=("ApiRefused", api_refused_message(e)))
                raise kopf.PermanentError(f"API server refused a child: {e}") from e
            metrics.errors.labels(kind="temporary").inc()
            delay = config.retry_seconds * (6 if e.status == 403 else 1)
            raise kopf.TemporaryError(f"API error, retrying: {e}", delay=delay) from e
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            metrics.errors.labels(kind="temporary").inc()
            metrics.reconciles.labels(trigger=trigger, result="error").inc()
            raise kopf.TemporaryError(f"cannot reach the API server: {e!r}", delay=config.retry_seconds) from e
    metrics.reconciles.labels(trigger=trigger, result="ok").inc()
    metrics.set_managed(key, result.kinds)
    if status is not None:
        ready = next((c["status"] for c in status["conditions"] if c["type"] == "Ready"), "Unknown")
        metrics.set_ready(key, ready)
    corrected = [k for k, o in result.outcomes.items() if o is Outcome.CORRECTED]
    if corrected:
        logger.warning(f"put back {', '.join(corrected)}: changed by someone else, no longer what the spec "
                       "says (edit the InferenceService instead)")
    if result.switching:
        logger.info(f"switching mode: the old engine roles and the router stay until {result.switching}")
    changed = {k: o.value for k, o in result.outcomes.items() if o not in (Outcome.UNCHANGED, Outcome.CORRECTED)}
    if changed or result.pruned:
        logger.info(f"applied {changed or 'nothing'}, pruned {result.pruned or 'nothing'}")


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
async def reconcile_spec(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, reason: str,
                         **_: Any) -> None:
    await run_reconcile(body, memo, logger, trigger=str(reason))


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)
async def resync(stopped: kopf.DaemonStopped, name: str, namespace: str, memo: kopf.Memo,
                 logger: logging.Logger, **_: Any) -> None:
    """Every resync period: re-apply (recreates what was deleted) and recompute the status."""
    while not await stopped.wait(memo.config.resync_seconds):
        body = await memo.client.get(KINDS[naming.KIND], namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            await run_reconcile(body, memo, logger, trigger="resync")
        except (kopf.PermanentError, kopf.TemporaryError) as e:
            logger.warning(f"resync: {e}")


IDLE_PLANNER_SECONDS = 15.0  # how often a service without the planner is looked at again


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0)
async def planner(stopped: kopf.DaemonStopped, name: str, namespace: str, memo: kopf.Memo,
                  logger: logging.Logger, **_: Any) -> None:
    """spec.autoscaling.mode planner: every intervalSeconds, scrape the engines, plan, scale, say why
    (baton.operator.autoscaler). Its state starts over when the mode or the planner's config changes; at
    start it takes back the stabilisation memory an earlier operator left in the status."""
    state, config, interval, started = PlannerState(), None, IDLE_PLANNER_SECONDS, False
    async with aiohttp.ClientSession() as session:
        while not await stopped.wait(interval):
            body = await memo.client.get(KINDS[naming.KIND], namespace, name)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            try:
                isvc = parse(body)
            except InvalidSpec:
                continue
            if isvc.spec.planner != config or not started:
                previous = (body.get("status") or {}).get("autoscaling")
                state = PlannerState() if started else PlannerState.from_status(previous)
                config, started = isvc.spec.planner, True
            interval = config.interval_seconds if config is not None else IDLE_PLANNER_SECONDS
            try:
                if config is None:
                    if (body.get("status") or {}).get("autoscaling") is not None:
                        await memo.client.patch(KINDS[naming.KIND], namespace, name,
                                                {"status": {"autoscaling": None}}, sub="status")
                    continue
                await planner_step(memo.client, session, isvc, state, time.time(),
                                   lambda reason, message: kopf.event(body, type="Normal", reason=reason,
                                                                      message=message),
                                   memo.config.metrics_url, memo.config.prometheus_url)
            except (ApiError, aiohttp.ClientError, asyncio.TimeoutError) as e:
                logger.warning(f"planner: no decision this time: {e}")


def _drifted(isvc: Mapping[str, Any], deployment: Mapping[str, Any]) -> bool:
    """The live child Deployment no longer holds what the spec says (someone edited it)."""
    try:
        desired = build_children(parse(isvc))
    except InvalidSpec:
        return False
    name = deployment.get("metadata", {}).get("name")
    want = next((o for o in desired if o["kind"] == "Deployment" and o["metadata"]["name"] == name), None)
    # replicas an HPA or the planner set are not drift (apply() keeps them too)
    return want is not None and isinstance(deployment, dict) and drift(deployment, keep_live_replicas(deployment, want))


@kopf.on.event("apps", "v1", "deployments", labels=CHILD_LABELS)
async def child_deployment_event(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo,
                                 logger: logging.Logger, **_: Any) -> None:
    """A child Deployment changed: follow its status; if it was deleted or edited, put it back."""
    owner = body.get("metadata", {}).get("labels", {}).get(naming.SERVICE_LABEL)
    namespace = body.get("metadata", {}).get("namespace")
    if not owner or not namespace:
        return
    client: KubeClient = memo.client
    try:
        if event.get("type") == "DELETED":
            isvc = await client.get(KINDS[naming.KIND], namespace, owner)
            if isvc is not None and not isvc["metadata"].get("deletionTimestamp"):
                await run_reconcile(isvc, memo, logger, trigger="child-deleted")
            return
        async with _lock(memo, (namespace, owner)):  # read the owner after any running reconcile
            isvc = await client.get(KINDS[naming.KIND], namespace, owner)
            if isvc is None or isvc["metadata"].get("deletionTimestamp"):
                return
            drifted = _drifted(isvc, event.get("object") or {})
            switching = not drifted and await switch_pending(client, isvc)
            status = None if drifted or switching else await refresh_status(client, isvc)
        if drifted:
            await run_reconcile(isvc, memo, logger, trigger="child-drifted")
        elif switching:
            await run_reconcile(isvc, memo, logger, trigger="mode-switch")
        elif status is not None:
            ready = next((c["status"] for c in status["conditions"] if c["type"] == "Ready"), "Unknown")
            memo.metrics.set_ready((namespace, owner), ready)
    except (ApiError, aiohttp.ClientError, asyncio.TimeoutError, kopf.TemporaryError) as e:
        memo.metrics.errors.labels(kind="status").inc()
        logger.warning(f"status of {namespace}/{owner} not refreshed (the resync will): {e}")
    except kopf.PermanentError:
        pass  # the spec is invalid; its status already says so


@kopf.on.event("batch", "v1", "jobs", labels=CHILD_LABELS)
async def weights_job_event(event: Mapping[str, Any], body: kopf.Body, memo: kopf.Memo,
                            logger: logging.Logger, **_: Any) -> None:
    """A weights Job (spec.model.updateStrategy InPlace) finished: record its outcome now, not at the
    next resync, so the model ConfigMap names the version the engines serve as soon as they do."""
    meta = body.get("metadata", {})
    owner, namespace = (meta.get("labels") or {}).get(naming.SERVICE_LABEL), meta.get("namespace")
    done = any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
               for c in (body.get("status") or {}).get("conditions", []))
    if not owner or not namespace or not done or event.get("type") == "DELETED":
        return
    try:
        isvc = await memo.client.get(KINDS[naming.KIND], namespace, owner)
        if isvc is not None and not isvc["metadata"].get("deletionTimestamp"):
            await run_reconcile(isvc, memo, logger, trigger="weights-job")
    except (ApiError, aiohttp.ClientError, asyncio.TimeoutError, kopf.TemporaryError) as e:
        logger.warning(f"weights Job of {namespace}/{owner} not followed up (the resync will): {e}")
    except kopf.PermanentError:
        pass  # the spec is invalid; its status already says so


@kopf.on.delete(*RESOURCE, optional=True)
async def deleted(namespace: str, name: str, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """Children go with the owner (garbage collection by owner references); only forget it here."""
    memo.metrics.forget((namespace, name))
    memo.locks.pop((namespace, name), None)
    logger.info("deleted; Kubernetes garbage-collects its children")


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    await memo.client.close()
    server = getattr(memo, "metrics_server", None)
    if server is not None:
        server.shutdown()
        server.server_close()
