"""Pure functions from Kubernetes pod JSON to worker specs."""
from __future__ import annotations

from typing import Any

from baton.router.config import DiscoveryConfig, WorkerRole, WorkerSpec


def selector_string(selector: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def matches(pod: dict[str, Any], selector: dict[str, str]) -> bool:
    """The API server filters by selector already; checked again so a lenient server cannot leak pods."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def is_ready(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if (pod.get("metadata") or {}).get("deletionTimestamp") or status.get("phase") != "Running":
        return False
    if not status.get("podIP"):
        return False
    conditions = status.get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_to_spec(pod: dict[str, Any], role: WorkerRole, config: DiscoveryConfig) -> WorkerSpec | None:
    """The worker this pod serves as, or None while it is not Running and Ready."""
    if not is_ready(pod):
        return None
    ip = pod["status"]["podIP"]
    host = f"[{ip}]" if ":" in ip else ip
    port = None
    if role is WorkerRole.PREFILL:
        annotation = ((pod.get("metadata") or {}).get("annotations") or {}).get(config.bootstrap_port_annotation)
        port = _port(annotation)
    return WorkerSpec(f"http://{host}:{config.port}", role, port)


def pod_key(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _port(value: Any) -> int | None:
    try:
        port = int(value)
    except (TypeError, ValueError):
        return None
    return port if 0 < port < 65536 else None
