"""Fixtures: fake workers, routers and an HTTP client, all stopped at the end of each test."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import aiohttp
import pytest

# router_fake_worker.py and router_support.py: tests run in importlib mode, so their folder goes on
# sys.path; the "router_" prefix keeps the names unique across test folders.
sys.path.insert(0, str(Path(__file__).parent))

from router_fake_worker import FakeWorker  # noqa: E402
from router_support import make_config, wait_until  # noqa: E402

from baton.router.config import RouterConfig  # noqa: E402
from baton.router.server import Router  # noqa: E402


@pytest.fixture
async def fake_workers() -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    started: list[FakeWorker] = []

    async def make(name: str = "worker", **behavior: Any) -> FakeWorker:
        worker = await FakeWorker(name, **behavior).start()
        started.append(worker)
        return worker

    yield make
    for worker in started:
        await worker.stop()


@pytest.fixture
async def routers() -> AsyncIterator[Callable[..., Awaitable[Router]]]:
    started: list[Router] = []

    async def make(config: RouterConfig | None = None, wait_ready: bool = True, **kwargs: Any) -> Router:
        router = Router(config or make_config(**kwargs))
        await router.start()
        started.append(router)
        if wait_ready:
            await wait_until(lambda: router.routable()[0], what="router has healthy workers")
        return router

    yield make
    for router in started:
        await router.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session

