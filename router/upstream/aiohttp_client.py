"""The obvious upstream client: aiohttp's ClientSession. Kept beside `lean.py` (`--upstream-client
aiohttp`) as the reference the tests compare against, and used for https workers."""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

import aiohttp

from baton.router.upstream.base import Upstream, UpstreamError, UpstreamResponse

_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


class AiohttpResponse(UpstreamResponse):
    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except _ERRORS as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except _ERRORS as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc

    def release(self) -> None:
        self._resp.release()


class AiohttpUpstream(Upstream):
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session  # owned by the router, shared with the control plane

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> UpstreamResponse:
        try:
            resp = await self._session.post(url, data=body, headers={"Content-Type": "application/json", **headers})
        except _ERRORS as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from exc
        return AiohttpResponse(resp)

    async def close(self) -> None:
        pass
