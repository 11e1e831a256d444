"""Fixtures for operator tests.

The operator tests run against an emulated API server (kmock) by default. Set BATON_TEST_KUBECONFIG to a
kubeconfig of a real control plane (kube-apiserver + etcd + controller-manager + kwok) to run the same
tests there; `Cluster.settle()` then waits for the real controllers instead of writing statuses.
BATON_TEST_OPERATOR_KUBECONFIG (optional) is the operator's own identity there (its ServiceAccount's
token, so RBAC applies); on a real cluster each test's operator watches only that test's namespace, as
each emulated test has an API server of its own.
"""
from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from baton_testing.kube.cluster import Cluster, emulated_cluster, real_cluster

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "manifests" / "samples"
_ids = itertools.count()
NAMESPACE_PREFIX = "baton-test-"


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def samples() -> dict[str, dict[str, Any]]:
    """manifests/samples/*.yaml by file name."""
    out = {}
    for path in sorted(SAMPLES.glob("*.yaml")):
        with open(path) as f:
            out[path.name] = yaml.safe_load(f)
    assert out, f"no samples in {SAMPLES}"
    return out


@pytest.fixture(params=[False, True], ids=["no-monitoring-crds", "monitoring-crds"])
def monitoring_crds(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    kubeconfig = os.environ.get("BATON_TEST_KUBECONFIG")
    if kubeconfig:
        operator_kubeconfig = os.environ.get("BATON_TEST_OPERATOR_KUBECONFIG") or None
        async with real_cluster(kubeconfig, operator_kubeconfig, watch_namespaces=(f"{NAMESPACE_PREFIX}*",)) as c:
            yield c
        return
    monitoring = request.getfixturevalue("monitoring_crds") if "monitoring_crds" in request.fixturenames else False
    async with emulated_cluster(monitoring=monitoring) as c:
        yield c


@pytest.fixture
async def namespace(cluster: Cluster) -> str:
    name = f"{NAMESPACE_PREFIX}{os.getpid()}-{next(_ids)}"
    await cluster.create_namespace(name)
    if not cluster.emulated:  # a shared cluster: the test's operator sees only its test's objects
        cluster.watch_namespaces = (name,)
    return name
