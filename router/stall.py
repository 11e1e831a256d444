"""Stall detection: a worker that holds requests and stops answering has them ended, and no new ones.

A stopped worker (a SIGSTOPped process, a wedged event loop) would otherwise keep its clients waiting
until the request timeout (30 min by default). While a worker holds requests, it is probed (GET the
health endpoint; any HTTP answer counts, the status does not) every `interval` seconds. When no probe
has been answered for `timeout` seconds, the worker is marked stalled: it gets no new requests, and
each request it holds is told (its `on_stall` callback ends the client's stream, or retries, and
aborts the PD partner). A stalled worker keeps being probed, requests or not, and is routable again
once it answers.

A dead worker is not a stall: its connections break and the requests fail at once. A probe that is
refused counts as unanswered all the same, in case the worker stopped while the kernel still holds
the connections.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Callable

import aiohttp

from baton.router.registry import WorkerRegistry
from baton.router.worker import Worker

logger = logging.getLogger(__name__)


class StallWatch:
    def __init__(self, timeout_secs: float, endpoint: str, recheck_secs: float, workers: WorkerRegistry,
                 client: aiohttp.ClientSession) -> None:
        self.timeout = timeout_secs  # 0: disabled
        self.interval = min(max(timeout_secs / 5, 0.05), 5.0)  # probe period while requests are held
        self.recheck = min(recheck_secs, self.interval)  # probe period of a stalled worker
        self.endpoint = endpoint
        self.workers = workers
        self.client = client
        self._held: dict[Worker, dict[int, Callable[[], None]]] = {}  # worker -> {hold id: on_stall}
        self._watchers: dict[Worker, asyncio.Task] = {}
        self._ids = itertools.count()

    def hold(self, worker: Worker, on_stall: Callable[[], None]) -> Callable[[], None]:
        """Register a request `worker` now holds; returns the function that releases it. `on_stall`
        runs at most once, if the worker stalls while the request is held."""
        if not self.timeout:
            return _nothing
        if worker.stalled:  # picked just before it stalled: told as soon as the caller awaits
            asyncio.get_running_loop().call_soon(on_stall)
            return _nothing
        key = next(self._ids)
        self._held.setdefault(worker, {})[key] = on_stall
        if worker not in self._watchers:
            self._watchers[worker] = asyncio.ensure_future(self._watch(worker))
        return lambda: self._release(worker, key)

    async def stop(self) -> None:
        tasks = list(self._watchers.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _release(self, worker: Worker, key: int) -> None:
        held = self._held.get(worker)
        if held is not None:
            held.pop(key, None)
            if not held:
                del self._held[worker]

    async def _watch(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        last_answer = loop.time()  # it was routable when the first request went to it
        try:
            while self._registered(worker) and (worker in self._held or worker.stalled):
                await asyncio.sleep(self.recheck if worker.stalled else self.interval)
                budget = self.recheck if worker.stalled else last_answer + self.timeout - loop.time()
                if await self._answers(worker, max(budget, 0.01)):
                    last_answer = loop.time()
                    self.workers.set_stalled(worker, False)
                elif not worker.stalled and loop.time() - last_answer >= self.timeout:
                    self._stalled(worker, loop.time() - last_answer)
        finally:
            del self._watchers[worker]

    def _stalled(self, worker: Worker, silent_secs: float) -> None:
        held = self._held.pop(worker, {})
        logger.warning("%s worker %s answered no probe for %.1fs: ending its %d open requests",
                       worker.role.value, worker.url, silent_secs, len(held))
        self.workers.set_stalled(worker, True)
        for on_stall in held.values():
            on_stall()

    async def _answers(self, worker: Worker, timeout: float) -> bool:
        try:
            async with self.client.get(worker.url + self.endpoint,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                return True
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            return False

    def _registered(self, worker: Worker) -> bool:
        return self.workers.get(worker.url, worker.role) is worker


def _nothing() -> None:
    pass
