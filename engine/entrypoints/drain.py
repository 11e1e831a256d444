"""Draining: how an engine leaves service without losing a request.

SIGTERM (what the kubelet sends when a pod goes: a rollout, a scale-down, a node drain) or `POST /drain`
turns an engine into a draining one:

    /health            503  -> the readiness probe fails: the pod leaves its Service and the router's list
    new generations    503 + Retry-After, error type "draining" -> the router picks another worker at once
    running requests   finish; a prefill's requests end when their KV has reached the decode, so the
                       transfers of requests already handed over are served to the end
    everything else    answered (/metrics, /get_server_info, /abort_request: the router may still abort)

Once no request is left the HTTP server stops, and with it the scheduler and detokenizer: the process
exits 0 well inside the pod's terminationGracePeriodSeconds (the kubelet's SIGKILL is the bound).
The listener stays open while draining: a refusal the router can read beats a refused connection, and
a request already on its way over a kept-alive connection gets an answer instead of a reset.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, Optional

import uvicorn
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)

# Routes that start a generation: refused while draining. (Control and read routes stay open.)
GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1
DRAINING_ERROR_TYPE = "draining"  # the router reads it from the 503 body (router/forward.py)
IDLE_POLL_S = 0.05


class Drain:
    """Whether this engine drains, since when and why. Set once; never undone (the process exits)."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self.since: Optional[float] = None  # time.monotonic() when it began

    @property
    def active(self) -> bool:
        return self.reason is not None

    def begin(self, reason: str) -> bool:
        """Start draining; False if it already was."""
        if self.active:
            return False
        self.reason, self.since = reason, time.monotonic()
        logger.info("draining (%s): refusing new requests, finishing the running ones", reason)
        return True

    def refusal(self) -> JSONResponse:
        message = f"this engine is draining ({self.reason}): send the request to another engine"
        return JSONResponse({"error": {"message": message, "type": DRAINING_ERROR_TYPE, "code": 503}},
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


async def stop_when_idle(drain: Drain, tm: Any, server: uvicorn.Server) -> None:
    """Once draining and no request is left in the tokenizer manager (a prefill's request stays until
    its KV transfer is done), stop the HTTP server; the caller then stops the other processes."""
    while not drain.active:
        await asyncio.sleep(IDLE_POLL_S)
    logger.info("draining: %d request(s) still running", len(tm.states))
    while tm.states:
        await asyncio.sleep(IDLE_POLL_S)
    logger.info("drained in %.1fs: stopping", time.monotonic() - (drain.since or time.monotonic()))
    server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM drains (see the module doc) instead of closing the listener at once.
    A second SIGTERM, or SIGINT (Ctrl-C), stops as uvicorn does. The signal is re-raised by uvicorn after
    the server has stopped, where `engine._exit_after_drain` turns it into exit code 0."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and self.drain.begin("SIGTERM"):
            captured = getattr(self, "_captured_signals", None)  # uvicorn >= 0.29 re-raises these at exit
            if captured is not None:
                captured.append(sig)
            return
        super().handle_exit(sig, frame)
