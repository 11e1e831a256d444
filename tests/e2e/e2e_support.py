"""Helpers of the end-to-end tests: polling with deadlines, kubectl JSON, owners, printer columns, and
processes (the operator, the router) stopped with their process group."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from baton_testing.kube.controlplane import ControlPlane

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
SERVICE_LABEL = "baton.dev/inference-service"
ROLE_LABEL = "baton.dev/role"
# Every kind the operator creates for an InferenceService, plus what the controllers make of them.
CHILD_KINDS = "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,configmaps,secrets,networkpolicies"


def wait_for(probe: Callable[[], T], what: str, timeout: float = 90.0, interval: float = 0.3) -> T:
    """Poll `probe` until it returns something truthy; fail saying `what` (and the last value)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def get_json(cp: ControlPlane, *args: str) -> dict[str, Any]:
    return json.loads(cp.kubectl("get", *args, "-o", "json").stdout)


def get_or_none(cp: ControlPlane, *args: str) -> dict[str, Any] | None:
    result = cp.kubectl("get", *args, "-o", "json", check=False)
    if result.returncode != 0:
        assert "NotFound" in result.stderr, result.stderr
        return None
    return json.loads(result.stdout)


def children(cp: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    """Everything labelled as belonging to InferenceService `name`."""
    return get_json(cp, CHILD_KINDS, "-n", namespace, "-l", f"{SERVICE_LABEL}={name}")["items"]


def conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in ((obj or {}).get("status") or {}).get("conditions", [])}


def isvc_condition(cp: ControlPlane, namespace: str, name: str, ctype: str, status: str,
                   timeout: float = 90.0) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        obj = get_or_none(cp, "inferenceservice", name, "-n", namespace)
        return obj if conditions(obj).get(ctype, {}).get("status") == status else None
    return wait_for(probe, f"InferenceService {namespace}/{name} {ctype}={status}", timeout)


def can_i(cp: ControlPlane, verb: str, resource: str, namespace: str | None, user: str) -> subprocess.CompletedProcess:
    """`kubectl auth can-i` as `user`; `resource` may name a subresource (`deployments.apps/scale`)."""
    resource, _, sub = resource.partition("/")
    args = ["auth", "can-i", verb, resource, f"--as={user}"]
    args += [f"--subresource={sub}"] if sub else []
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    return cp.kubectl(*args, check=False)


def controller_of(obj: dict[str, Any]) -> dict[str, Any]:
    [ref] = [r for r in obj["metadata"].get("ownerReferences", []) if r.get("controller")]
    return ref


def pod_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return (st.get("phase") == "Running" and not pod["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", [])))


def ready_pods(cp: ControlPlane, namespace: str, selector: str) -> list[dict[str, Any]]:
    return [p for p in get_json(cp, "pods", "-n", namespace, "-l", selector)["items"] if pod_ready(p)]


def printer_row(cp: ControlPlane, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get inferenceservices NAME -o wide` as {column: cell}; an empty cell is ''."""
    header, row = cp.kubectl("get", "inferenceservices", name, "-n", namespace, "-o", "wide").stdout.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    bounds = list(zip(starts, [*starts[1:], None]))
    return {header[a:b].strip(): row[a:b].strip() for a, b in bounds}


def sample(file: str, namespace: str | None = None, **spec: Any) -> dict[str, Any]:
    """A sample InferenceService, optionally moved to `namespace` and with spec keys replaced."""
    body = yaml.safe_load((SAMPLES / file).read_text())
    body = copy.deepcopy(body)
    if namespace:
        body["metadata"]["namespace"] = namespace
    body["spec"].update(spec)
    return body


def create_namespace(cp: ControlPlane, name: str) -> str:
    cp.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])
    wait_for(lambda: cp.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             f"the default ServiceAccount of {name}")
    return name


@contextlib.contextmanager
def background(argv: list[str], log: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """Run a process (own process group, output to `log`); stop the group on exit, also on failure."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def tail(path: str, lines: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def baton_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "baton", *args]
