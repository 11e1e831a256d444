"""spec.model.updateStrategy InPlace, one reconcile step at a time (kopf-free, like the reconciler).

The model ConfigMap says which source the engines serve; the spec says which they should. When they
differ, the weights Job of the spec's source fetches it into the shared cache and asks the router to
update every engine (builders/weights.py). Its outcome becomes the WeightsUpdated condition; only a
Job that succeeded moves the ConfigMap to the new source, so pods started later load what the others
serve, and a failure leaves the old weights serving and the ConfigMap as it was.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from baton.operator import naming
from baton.operator.apply import controlled_by, prune
from baton.operator.builders.weights import (SOURCE_KEY, VERSION_KEY, model_config_map,
                                             version_data, weights_job)
from baton.operator.kube import KINDS, KubeClient
from baton.operator.spec import InferenceService


@dataclass(frozen=True)
class WeightsState:
    """The WeightsUpdated condition and what the engines serve (status.model)."""

    ok: bool
    reason: str  # Serving, Updated, Updating, UpdateFailed
    message: str
    source: str  # the source the engines serve
    weight_version: str


def _finished(job: Mapping[str, Any]) -> str | None:
    """'Complete' or 'Failed' once the Job is done, else None."""
    for c in (job.get("status") or {}).get("conditions", []):
        if c.get("type") in ("Complete", "Failed") and c.get("status") == "True":
            return c["type"]
    return None


async def _failure_reason(client: KubeClient, job: Mapping[str, Any]) -> str:
    """What the Job's containers wrote to their termination messages (`baton fetch-model`'s reason, or
    the router's answer), newest pod first; else the Job's own condition."""
    meta = job["metadata"]
    pods = await client.list(KINDS["Pod"], meta["namespace"], {"job-name": meta["name"]})
    pods = [p for p in pods if (p.get("metadata", {}).get("labels") or {}).get("job-name") == meta["name"]]
    pods.sort(key=lambda p: p.get("metadata", {}).get("creationTimestamp", ""), reverse=True)
    for pod in pods:
        st = pod.get("status") or {}
        for cs in [*st.get("initContainerStatuses", []), *st.get("containerStatuses", [])]:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term.get("exitCode") and term.get("message"):
                return f"{cs.get('name')}: {term['message'].strip()}"
    failed = next((c for c in (job.get("status") or {}).get("conditions", []) if c.get("type") == "Failed"), {})
    return f"{failed.get('reason', 'Failed')}: {failed.get('message', 'the Job failed')}"


async def _other_active_job(client: KubeClient, isvc: InferenceService, name: str) -> str | None:
    """A weights Job of another source still running: its update must land before the next one starts."""
    jobs = await client.list(KINDS["Job"], isvc.namespace, {naming.SERVICE_LABEL: isvc.name})
    prefix = naming.weights_job(isvc.name, "")[:-8]
    for job in jobs:
        meta = job.get("metadata", {})
        if meta.get("name", "").startswith(prefix) and meta.get("name") != name \
                and controlled_by(job, isvc.uid) and _finished(job) is None:
            return meta["name"]
    return None


async def weights_step(client: KubeClient, isvc: InferenceService) -> WeightsState | None:
    """Take the next step towards serving spec.model.source in place; None when the spec is not InPlace
    (its model ConfigMap, if any, is pruned: the pod templates name the source again)."""
    m = isvc.spec.model
    if not m.in_place:
        await prune(client, "ConfigMap", isvc.namespace, naming.model_config(isvc.name), isvc.uid)
        return None
    assert m.source is not None
    want = m.source.uri
    cm = await client.get(KINDS["ConfigMap"], isvc.namespace, naming.model_config(isvc.name))
    if cm is None:  # new pods start from the spec's source: nothing runs an older one
        await client.create(model_config_map(isvc, m.source))
        return WeightsState(True, "Serving", f"the engines start from {want}.", want, want)
    data = cm.get("data") or {}
    serving, version = data.get(SOURCE_KEY, ""), data.get(VERSION_KEY, "")
    if serving == want:
        return WeightsState(True, "Serving", f"the engines serve {want} (weight version {version}).",
                            serving, version)
    return await _update_step(client, isvc, serving, version)


async def _update_step(client: KubeClient, isvc: InferenceService, serving: str, version: str) -> WeightsState:
    m = isvc.spec.model
    assert m.source is not None
    want, name = m.source.uri, naming.weights_job(isvc.name, m.source.uri)
    still = f"the engines serve {serving} until then"
    job = await client.get(KINDS["Job"], isvc.namespace, name)
    if job is None:
        other = await _other_active_job(client, isvc, name)
        if other is not None:
            return WeightsState(False, "Updating", f"waiting for Job {other} (an earlier source) to finish before "
                                                   f"updating to {want}; {still}.", serving, version)
        job = await client.create(weights_job(isvc))
    done = _finished(job)
    if done is None:
        return WeightsState(False, "Updating",
                            f"Job {name} fetches {want} into the cache (PVC {m.cache_claim}), then the router "
                            f"updates every engine in place; {still}. Progress: `kubectl -n {isvc.namespace} "
                            f"logs job/{name} --all-containers`.", serving, version)
    if done == "Failed":
        why = await _failure_reason(client, job)
        return WeightsState(False, "UpdateFailed",
                            f"updating the engines in place to {want} failed ({why}); the engines still serve "
                            f"{serving}. Fix spec.model.source/fetch or the router, then delete Job {name} to "
                            f"retry, or set spec.model.source back.", serving, version)
    await client.patch(KINDS["ConfigMap"], isvc.namespace, naming.model_config(isvc.name),
                       {"data": version_data(m.source)})
    # a finished Job is one update: kept, a later switch back to this source would pass for done
    await client.delete(KINDS["Job"], isvc.namespace, name)
    return WeightsState(True, "Updated", f"the engines serve {want} (weight version {want}), updated in place "
                                         f"by Job {name}; pods started from now on load it too.", want, want)
