"""Upstream HTTP clients for the inference hot path: `base.Upstream` is the contract; `lean.py` is
the fast one (default), `aiohttp_client.py` the obvious one."""
from __future__ import annotations

import aiohttp

from baton.router.config import UpstreamClient
from baton.router.upstream.base import Upstream, UpstreamError, UpstreamResponse


def create_upstream(kind: UpstreamClient, session: aiohttp.ClientSession) -> Upstream:
    from baton.router.upstream.aiohttp_client import AiohttpUpstream
    fallback = AiohttpUpstream(session)
    if kind is UpstreamClient.AIOHTTP:
        return fallback
    from baton.router.upstream.lean import LeanUpstream
    return LeanUpstream(fallback)


__all__ = ["Upstream", "UpstreamError", "UpstreamResponse", "create_upstream"]
