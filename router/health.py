"""Health checking: a new worker is probed at the startup interval until it first answers (then it
is routable at once); after that every `interval_secs`, with failure/success thresholds.

A worker whose circuit breaker opened is probed at the startup interval too: once it has been seen
down (the breaker opened on a transport error, or a probe failed) and answers again, the breaker
turns half-open at once instead of after `--cb-timeout-duration-secs` (a restarted worker comes
back in about a second). A worker that passes its probes while its requests fail keeps the timeout:
its /health tells nothing about why they fail.

In DP-aware mode the first answer must also include the DP size (`/get_server_info`, "dp_size";
missing means 1), because a worker's targets are its ranks.
"""
from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson

from baton.router.circuit_breaker import BreakerState
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
        self._watched_breakers: set[Worker] = set()
        workers.on_added.append(self._on_added)
        workers.on_breaker_opened.append(self._on_breaker_opened)
        workers.on_draining.append(lambda worker: self._spawn(self._until_undrained(worker)))

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

    def _on_breaker_opened(self, worker: Worker, unreachable: bool) -> None:
        if self.health.enabled and worker not in self._watched_breakers:
            self._watched_breakers.add(worker)
            self._spawn(self._until_back(worker, seen_down=unreachable))

    async def _until_back(self, worker: Worker, seen_down: bool) -> None:
        try:
            while self.workers.get(worker.url, worker.role) is worker and worker.breaker.state is BreakerState.OPEN:
                await asyncio.sleep(self.health.startup_check_interval_secs)
                if not await self.is_healthy(worker):
                    seen_down = True
                elif seen_down:
                    self.workers.half_open(worker)
        finally:
            self._watched_breakers.discard(worker)

    async def _until_undrained(self, worker: Worker) -> None:
        """A draining engine fails /health until it stops; a new one on the same URL (a static worker
        restarted) answers 200 and is routable again."""
        while self.workers.get(worker.url, worker.role) is worker and worker.draining:
            await asyncio.sleep(self.health.startup_check_interval_secs)
            if await self.is_healthy(worker):
                self.workers.set_draining(worker, False)

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
