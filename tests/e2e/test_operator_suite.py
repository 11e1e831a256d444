"""tests/operator/test_operator.py, written against a cluster facade, re-run here on the real control plane
(BATON_TEST_KUBECONFIG), with the operator logged in as its ServiceAccount (BATON_TEST_OPERATOR_KUBECONFIG)
and watching only that suite's `baton-test-*` namespaces. A pytest of its own: the suite's fixtures read
the environment when they start."""
from __future__ import annotations

import os
import subprocess
import sys

from e2e_support import REPO

from baton_testing.kube.controlplane import ControlPlane

SUITE = REPO / "tests" / "operator" / "test_operator.py"


def test_operator_suite_passes_on_the_real_control_plane(control_plane: ControlPlane, installed: str):
    operator_kubeconfig = control_plane.service_account_kubeconfig("baton-system", "baton-operator")
    env = {**os.environ, "BATON_TEST_KUBECONFIG": control_plane.kubeconfig,
           "BATON_TEST_OPERATOR_KUBECONFIG": operator_kubeconfig,
           "KUBECONFIG": control_plane.kubeconfig}  # what a user would have set; the operator must not use it
    result = subprocess.run([sys.executable, "-m", "pytest", str(SUITE), "-q", "-p", "no:cacheprovider", "-x"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=500, check=False)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert result.returncode == 0, f"{summary}\n{result.stdout[-8000:]}\n{result.stderr[-3000:]}"
    assert " passed" in summary and "skipped" not in summary, summary
