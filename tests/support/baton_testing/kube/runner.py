"""Run the real operator (kopf + Baton's handlers) against a Cluster, in a thread of its own.

kopf's shutdown waits for, then cancels, every task created in its event loop after it started (it
assumes the loop is its own), so it gets a loop of its own here: an emulated API server serving from
the test's loop keeps its connection tasks.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator

import kopf

import baton.operator.handlers  # noqa: F401  (registers the handlers)
from baton.operator.config import OperatorConfig
from baton_testing.kube.cluster import Cluster


@contextlib.asynccontextmanager
async def run_operator(cluster: Cluster, config: OperatorConfig | None = None,
                       startup_timeout: float = 20.0) -> AsyncIterator[kopf.Memo]:
    """Start the operator (cluster-wide, or in `cluster.watch_namespaces`); stop it (and wait for it) on
    exit, also on failure.

    Yields kopf's memo: `memo.metrics` is the running operator's OperatorMetrics.
    """
    config = config or OperatorConfig(resync_seconds=30, retry_seconds=0.5, metrics_port=None)
    memo = kopf.Memo(config=config)
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(kopf.operator(clusterwide=not cluster.watch_namespaces,
                                      namespaces=list(cluster.watch_namespaces), standalone=True, memo=memo,
                                      stop_flag=stop, ready_flag=ready))
        except BaseException as e:  # reported to the test on exit
            failure.append(e)

    objects_log = logging.getLogger("kopf.objects")  # what kopf posts as Events: INFO, as `baton operator` logs
    old_level = objects_log.level
    objects_log.setLevel(logging.INFO)
    old = os.environ.get("KUBECONFIG")
    # the operator logs in like it would outside a pod, with its own identity where the cluster has one
    os.environ["KUBECONFIG"] = cluster.operator_kubeconfig or cluster.kubeconfig
    thread = threading.Thread(target=main, name="baton-operator", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not ready.is_set():
            if not thread.is_alive() or time.monotonic() > deadline:
                raise AssertionError(f"the operator did not start: {failure or 'timeout'}")
            await asyncio.sleep(0.05)
        yield memo
    finally:
        stop.set()
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 30)
        objects_log.setLevel(old_level)
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old
        if thread.is_alive():
            raise AssertionError("the operator did not stop within 30s")
        if failure:
            raise failure[0]
