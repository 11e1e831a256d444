"""Closed-loop load: `concurrency` clients each send the next request as soon as the last returns."""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import aiohttp
import orjson


@dataclass(frozen=True)
class LoadResult:
    requests: int
    errors: int
    seconds: float
    latencies: tuple[float, ...]  # seconds, successful requests only

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def chat_body(i: int, stream: bool = False) -> bytes:
    return orjson.dumps({"model": "fake-model", "max_tokens": 16, "stream": stream, "messages": [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"}]})


async def run_load(session: aiohttp.ClientSession, url: str, requests: int, concurrency: int,
                   stream: bool = False, offset: int = 0) -> LoadResult:
    bodies = [chat_body(offset + i, stream) for i in range(requests)]
    latencies: list[float] = []
    errors = 0
    next_index = iter(range(requests))
    headers = {"Content-Type": "application/json"}

    async def client() -> None:
        nonlocal errors
        for i in next_index:
            started = time.perf_counter()
            try:
                async with session.post(url, data=bodies[i], headers=headers) as resp:
                    await resp.read()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                errors += 1

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return LoadResult(requests, errors, time.perf_counter() - started, tuple(latencies))


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
