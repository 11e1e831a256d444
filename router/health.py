"""Health checking: a new worker is probed at the startup interval until it first answers (then it
is routable at once); after that every `interval_secs`, with failure/success thresholds.

In DP-aware mode the first answer must also include the DP size (`/get_server_info`, "dp_size";
missing means 1), because a worker's targets are its ranks.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from baton.router.config import RouterConfig
from baton.router.registry import WorkerRegistry
from baton.router.worker import Worker

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, config: RouterConfig, workers: WorkerRegistry, client: aiohttp.ClientSession) -> None:
        self.config = config
        self.health = config.health
        self.workers = workers
        self.client = client
        self._tasks: set[asyncio.Task] = set()
        self._timeout = aiohttp.ClientTimeout(total=self.health.timeout_secs)
        workers.on_added.append(self._on_added)

    def start(self) -> None:
        for worker in self.workers.workers():
            if not worker.ready:
                self._on_added(worker)
        if self.health.enabled:
            self._spawn(self._periodic())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)

    # -- probes ----------------------------------------------------------------------------
    async def is_healthy(self, worker: Worker) -> bool:
        try:
            async with self.client.get(worker.url + self.health.endpoint, timeout=self._timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False

    async def dp_size(self, worker: Worker) -> int | None:
        for path in ("/get_server_info", "/server_info"):
            try:
                async with self.client.get(worker.url + path, timeout=self._timeout) as resp:
                    if resp.status == 200:
                        info = orjson.loads(await resp.read())
                        size = info.get("dp_size") if isinstance(info, dict) else None
                        return size if isinstance(size, int) and size >= 1 else 1
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, orjson.JSONDecodeError):
                continue
        return None

    # -- loops -----------------------------------------------------------------------------
    def _on_added(self, worker: Worker) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # registered before the loop runs: start() picks it up
            return
        if not worker.ready:
            self._spawn(self._until_ready(worker))

    async def _until_ready(self, worker: Worker) -> None:
        while self.workers.get(worker.url, worker.role) is worker and not worker.ready:
            if await self._first_probe(worker):
                worker.ready = True
                self.workers.set_healthy(worker, True)
                return
            await asyncio.sleep(self.health.startup_check_interval_secs)

    async def _first_probe(self, worker: Worker) -> bool:
        if self.health.enabled and not await self.is_healthy(worker):
            return False
        if self.config.dp_aware:
            size = await self.dp_size(worker)
            if size is None:
                return False
            self.workers.set_dp_size(worker, size)
        return True

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_secs)
            ready = [w for w in self.workers.workers() if w.ready]
            results = await asyncio.gather(*(self.is_healthy(w) for w in ready))
            for worker, ok in zip(ready, results):
                self.apply(worker, ok)

    def apply(self, worker: Worker, ok: bool) -> None:
        """Count one check; flip health after `threshold` consecutive results the other way."""
        if ok:
            worker.health_successes, worker.health_failures = worker.health_successes + 1, 0
            if not worker.healthy and worker.health_successes >= self.health.success_threshold:
                self.workers.set_healthy(worker, True)
        else:
            worker.health_failures, worker.health_successes = worker.health_failures + 1, 0
            if worker.healthy and worker.health_failures >= self.health.failure_threshold:
                self.workers.set_healthy(worker, False)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
