"""A real Kubernetes control plane on loopback for end-to-end tests (etcd, API server, controllers, kwok).

etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake nodes whose pods turn
Running and Ready without a kubelet or container runtime), built by e2e/build.sh:

    bin_dir = subprocess.check_output(["bash", "e2e/build.sh"], text=True).strip()
    with start_control_plane(bin_dir) as cp:
        cp.kubectl("apply", "-f", "manifests/")
        token_kubeconfig = cp.service_account_kubeconfig("baton-system", "baton-operator")

Certificates and the service-account keys are made at start (`pki.py`); every component listens on
127.0.0.1 on free ports; the API server authorizes with RBAC. Each component runs in a process group of
its own (and dies with this process), and everything is stopped and its directory removed on exit,
also when starting fails. `PYTHONPATH=tests/support python -m baton_testing.kube.controlplane` (what
e2e/cluster.sh runs) runs one until Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml

from baton.ports import free_port
from baton_testing.kube.fake_nodes import FAKE_NODES, KWOK_ANNOTATION
from baton_testing.kube.pki import Pki, make_pki

START_TIMEOUT = 180.0  # seconds per component; two busy cores can be slow to start a cold apiserver
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
ISSUER = "https://kubernetes.default.svc.cluster.local"
# What the operator's children need: rollouts (deployment, replicaset), cascading deletes
# (garbage-collector), service accounts and their tokens, Service endpoints, namespace deletion, the
# binding of the sample's PersistentVolumeClaim, and node-lifecycle, which lifts the not-ready taint
# the API server puts on every new node once kwok reports it Ready.
CONTROLLERS = ("deployment-controller", "replicaset-controller", "garbage-collector-controller",
               "serviceaccount-controller", "serviceaccount-token-controller", "endpointslice-controller",
               "namespace-controller", "persistentvolume-binder-controller", "node-lifecycle-controller",
               "disruption-controller")
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
# Fake nodes must never look lost. kwok's status heartbeat comes every 20-25 s, and gaps of 41 s were measured
# here (the controller manager's default grace is 50 s). A node the node-lifecycle controller marks Unknown even
# once gets its pods marked NotReady, and kwok never makes a Running pod Ready again: every later rollout on it
# waits forever. So kwok also renews each node's Lease (a kubelet's cheap heartbeat, every quarter of its
# duration), and the grace period is long: these tests never need a node to fail.
NODE_LEASE_SECONDS = 40
NODE_MONITOR_GRACE = "5m"


@dataclass
class Component:
    name: str
    process: subprocess.Popen
    log: str

    def tail(self, lines: int = 30) -> str:
        with open(self.log, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout)


@dataclass
class ControlPlane:
    workdir: str
    server: str
    kubeconfig: str  # admin (system:masters); components and tests that set things up use it
    pki: Pki
    kubectl_path: str
    components: dict[str, Component] = field(default_factory=dict)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True,
                kubeconfig: str | None = None, timeout: float = 60.0) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster; with `check`, a non-zero exit raises with its stderr."""
        cmd = [self.kubectl_path, "--kubeconfig", kubeconfig or self.kubeconfig, *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def apply(self, objects: list[dict[str, Any]], namespace: str | None = None) -> str:
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=yaml.safe_dump_all(objects)).stdout

    def service_account_kubeconfig(self, namespace: str, name: str, duration: str = "2h") -> str:
        """A kubeconfig that authenticates as ServiceAccount namespace/name with a bound token
        (TokenRequest, what a pod's projected token is), so RBAC applies to whoever uses it."""
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()
        path = os.path.join(self.workdir, f"kubeconfig-{namespace}-{name}.yaml")
        return write_kubeconfig(path, self.server, self.pki.ca_cert, {"token": token})

    def logs(self) -> str:
        return "\n".join(f"--- {c.name} (last lines of {c.log})\n{c.tail()}" for c in self.components.values())


def write_kubeconfig(path: str, server: str, ca_cert: str, user: dict[str, str]) -> str:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "e2e",
              "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority": ca_cert}}],
              "users": [{"name": "e2e", "user": user}],
              "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "e2e"}}]}
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    os.chmod(path, 0o600)
    return path


def _spawn(name: str, argv: list[str], workdir: str) -> Component:
    log = os.path.join(workdir, "logs", f"{name}.log")
    os.makedirs(os.path.dirname(log), exist_ok=True)
    if shutil.which("setpriv"):  # the component dies with us even if we are killed (SIGKILL, OOM)
        argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=workdir)
    return Component(name, proc, log)


def _wait(component: Component, probe: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if component.process.poll() is not None:
            raise RuntimeError(f"{component.name} exited with {component.process.returncode} before {what}:\n"
                               f"{component.tail()}")
        try:
            if probe():
                return
        except (OSError, urllib.error.URLError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{component.name}: timed out after {timeout}s waiting for {what}:\n{component.tail()}")


def _get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _insecure() -> ssl.SSLContext:
    """For the self-signed healthz endpoints of the controller manager and scheduler (loopback only)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _admin_context(pki: Pki) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.ca_cert)
    ctx.load_cert_chain(pki.admin_cert, pki.admin_key)
    return ctx


def _start_etcd(bin_dir: str, workdir: str) -> tuple[Component, str]:
    client, peer = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    etcd = _spawn("etcd", [
        os.path.join(bin_dir, "etcd"), "--name", "e2e", "--data-dir", os.path.join(workdir, "etcd"),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer, "--initial-cluster", f"e2e={peer}",
        "--unsafe-no-fsync", "--log-level", "warn"], workdir)
    _wait(etcd, lambda: json.loads(_get(f"{client}/health")[1]).get("health") == "true", "/health")
    return etcd, client


def _start_apiserver(bin_dir: str, workdir: str, pki: Pki, etcd: str) -> tuple[Component, str]:
    port = free_port()
    apiserver = _spawn("kube-apiserver", [
        os.path.join(bin_dir, "kube-apiserver"), "--etcd-servers", etcd,
        "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(port),
        "--cert-dir", os.path.join(workdir, "apiserver"),
        "--tls-cert-file", pki.server_cert, "--tls-private-key-file", pki.server_key,
        "--client-ca-file", pki.ca_cert, "--authorization-mode", "RBAC", "--anonymous-auth=false",
        "--service-account-issuer", ISSUER, "--service-account-key-file", pki.sa_pub,
        "--service-account-signing-key-file", pki.sa_key, "--service-cluster-ip-range", SERVICE_CIDR,
        # the `kubernetes` Service's Endpoints refuse a loopback address; nothing here needs them
        "--endpoint-reconciler-type", "none", "--enable-priority-and-fairness=false", "--profiling=false"],
        workdir)
    server = f"https://127.0.0.1:{port}"
    ctx = _admin_context(pki)
    _wait(apiserver, lambda: _get(f"{server}/readyz", ctx) == (200, b"ok"), "/readyz")
    return apiserver, server


def _start_controllers(bin_dir: str, workdir: str, pki: Pki, kubeconfig: str) -> list[Component]:
    common = ["--kubeconfig", kubeconfig, "--authentication-kubeconfig", kubeconfig,
              "--authorization-kubeconfig", kubeconfig, "--bind-address", "127.0.0.1", "--leader-elect=false"]
    kcm_port, sched_port = free_port(), free_port()
    kcm = _spawn("kube-controller-manager", [
        os.path.join(bin_dir, "kube-controller-manager"), *common, "--secure-port", str(kcm_port),
        "--cert-dir", os.path.join(workdir, "kcm"), "--controllers", ",".join(CONTROLLERS),
        "--service-account-private-key-file", pki.sa_key, "--root-ca-file", pki.ca_cert,
        "--cluster-cidr", POD_CIDR, "--service-cluster-ip-range", SERVICE_CIDR,
        "--node-monitor-grace-period", NODE_MONITOR_GRACE], workdir)
    scheduler = _spawn("kube-scheduler", [
        os.path.join(bin_dir, "kube-scheduler"), *common, "--secure-port", str(sched_port)], workdir)
    for component, port in ((kcm, kcm_port), (scheduler, sched_port)):
        _wait(component, lambda p=port: _get(f"https://127.0.0.1:{p}/healthz", _insecure())[0] == 200, "/healthz")
    return [kcm, scheduler]


def _start_kwok(bin_dir: str, workdir: str, kubeconfig: str) -> Component:
    return _spawn("kwok", [
        os.path.join(bin_dir, "kwok"), "--kubeconfig", kubeconfig, "--config", os.path.join(bin_dir, "kwok-stages.yaml"),
        "--manage-all-nodes=false", "--node-lease-duration-seconds", str(NODE_LEASE_SECONDS),
        f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake", "--cidr", "10.244.0.0/24",
        "--node-ip", "10.240.0.1", "--server-address", f"127.0.0.1:{free_port()}"], workdir)


def _nodes_ready(cp: ControlPlane) -> bool:
    out = cp.kubectl("get", "nodes", "-o", "json", check=False)
    if out.returncode != 0:
        return False
    ready = {n["metadata"]["name"] for n in json.loads(out.stdout)["items"]
             if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
             and not any(t["key"] == NOT_READY_TAINT for t in n.get("spec", {}).get("taints") or [])}
    return ready >= {n["metadata"]["name"] for n in FAKE_NODES}


def _default_service_account(cp: ControlPlane) -> bool:
    return cp.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0


@contextlib.contextmanager
def start_control_plane(bin_dir: str, workdir: str | None = None, kubectl: str = "kubectl",
                        keep: bool = False) -> Iterator[ControlPlane]:
    """Start the whole control plane and its fake nodes; stop everything on exit (also on failure).

    `keep` leaves the directory (logs, certificates, kubeconfig) for a post-mortem.
    """
    workdir = workdir or tempfile.mkdtemp(prefix="baton-e2e-")
    components: dict[str, Component] = {}
    try:
        pki = make_pki(os.path.join(workdir, "pki"))
        components["etcd"], etcd_url = _start_etcd(bin_dir, workdir)
        components["kube-apiserver"], server = _start_apiserver(bin_dir, workdir, pki, etcd_url)
        kubeconfig = write_kubeconfig(os.path.join(workdir, "kubeconfig.yaml"), server, pki.ca_cert,
                                      {"client-certificate": pki.admin_cert, "client-key": pki.admin_key})
        cp = ControlPlane(workdir, server, kubeconfig, pki, kubectl, components)
        for component in _start_controllers(bin_dir, workdir, pki, kubeconfig):
            components[component.name] = component
        cp.apply(FAKE_NODES)
        components["kwok"] = _start_kwok(bin_dir, workdir, kubeconfig)
        _wait(components["kwok"], lambda: _nodes_ready(cp), "the fake nodes to be Ready and schedulable")
        _wait(components["kube-controller-manager"], lambda: _default_service_account(cp),
              "the default ServiceAccount")
        yield cp
    finally:
        for component in reversed(list(components.values())):
            component.stop()
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a loopback Kubernetes control plane until Ctrl-C.")
    parser.add_argument("--bin-dir", required=True, help="where e2e/build.sh put the binaries")
    parser.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl")
    parser.add_argument("--workdir", default=None, help="default: a new temporary directory")
    parser.add_argument("--keep", action="store_true", help="keep the directory (logs, certificates) on exit")
    args = parser.parse_args(argv)
    stop = False

    def on_signal(*_: Any) -> None:
        nonlocal stop
        stop = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with start_control_plane(args.bin_dir, args.workdir, args.kubectl, args.keep) as cp:
        print(f"export KUBECONFIG={cp.kubeconfig}   # API server {cp.server}; Ctrl-C stops it", flush=True)
        while not stop and all(c.process.poll() is None for c in cp.components.values()):
            time.sleep(0.5)
        dead = [c.name for c in cp.components.values() if c.process.poll() is not None]
        if dead:
            print(f"stopped because {', '.join(dead)} exited:\n{cp.logs()}", flush=True)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
