"""The set of workers, by side, and the cached lists of targets that may receive requests now.

The hot path only reads `routable(role)`, a list rebuilt whenever something that decides it
changes (add/remove, health, breaker, DP size), so picking a target costs no filtering.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Iterable

from baton.router.circuit_breaker import CircuitBreaker
from baton.router.config import RouterConfig, WorkerRole, WorkerSpec
from baton.router.worker import Target, Worker

logger = logging.getLogger(__name__)


class WorkerExistsError(ValueError):
    pass


class WorkerRegistry:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._workers: dict[tuple[str, WorkerRole], Worker] = {}
        self._routable: dict[WorkerRole, list[Target]] = {role: [] for role in WorkerRole}
        self.on_added: list[Callable[[Worker], None]] = []  # e.g. the health checker's first probe
        self.on_removed: list[Callable[[Worker, list[Target]], None]] = []  # e.g. drop cache trees
        # (worker, unreachable): its breaker opened; unreachable when the last failure was a transport error
        self.on_breaker_opened: list[Callable[[Worker, bool], None]] = []
        self.on_draining: list[Callable[[Worker], None]] = []  # e.g. probe until it is ready again

    # -- membership ------------------------------------------------------------------------
    def add(self, spec: WorkerSpec, source: str = "static") -> Worker:
        key = (spec.url, spec.role)
        if key in self._workers:
            raise WorkerExistsError(f"{spec.role.value} worker {spec.url} is already registered")
        if spec.role not in self.config.roles:
            raise ValueError(f"a {spec.role.value} worker does not fit this router's mode")
        worker = Worker(spec, CircuitBreaker(self.config.circuit_breaker), source=source)
        worker.healthy = worker.ready = not self.config.health.enabled and not self.config.dp_aware
        self._workers[key] = worker
        logger.info("added %s worker %s (%s)", spec.role.value, spec.url, source)
        for hook in self.on_added:
            hook(worker)
        self.rebuild()
        return worker

    def remove(self, url: str, role: WorkerRole | None = None) -> list[Worker]:
        url = url.rstrip("/")
        gone = [w for (u, r), w in self._workers.items() if u == url and (role is None or r is role)]
        for worker in gone:
            del self._workers[(worker.url, worker.role)]
            logger.info("removed %s worker %s", worker.role.value, worker.url)
        self.rebuild()
        for worker in gone:
            for hook in self.on_removed:
                hook(worker, worker.targets)
        return gone

    def get(self, url: str, role: WorkerRole) -> Worker | None:
        return self._workers.get((url.rstrip("/"), role))

    def workers(self, role: WorkerRole | None = None) -> list[Worker]:
        return [w for w in self._workers.values() if role is None or w.role is role]

    def sync_source(self, source: str, specs: Iterable[WorkerSpec]) -> tuple[int, int]:
        """Make the workers owned by `source` equal `specs`; others are left alone. (added, removed)"""
        wanted = {(s.url, s.role): s for s in specs}
        have = {k: w for k, w in self._workers.items() if w.source == source}
        removed = 0
        for key, worker in have.items():
            if key not in wanted or wanted[key] != worker.spec:
                removed += len(self.remove(worker.url, worker.role))
        added = 0
        for key, spec in wanted.items():
            if key not in self._workers:
                self.add(spec, source)
                added += 1
        return added, removed

    # -- state -----------------------------------------------------------------------------
    def routable(self, role: WorkerRole) -> list[Target]:
        return self._routable[role]

    def set_healthy(self, worker: Worker, healthy: bool) -> None:
        if worker.healthy != healthy:
            worker.healthy = healthy
            logger.warning("%s worker %s is now %s", worker.role.value, worker.url,
                           "healthy" if healthy else "unhealthy")
            self.rebuild()

    def set_stalled(self, worker: Worker, stalled: bool) -> None:
        if worker.stalled != stalled:
            worker.stalled = stalled
            logger.warning("%s worker %s %s", worker.role.value, worker.url,
                           "stalled: no new requests until it answers again" if stalled else "answers again")
            self.rebuild()

    def set_draining(self, worker: Worker, draining: bool) -> None:
        """A draining worker gets no new request from this moment (it said so in a refusal)."""
        if worker.draining != draining:
            worker.draining = draining
            logger.warning("%s worker %s %s", worker.role.value, worker.url,
                           "is draining: no new requests" if draining else "is ready again")
            self.rebuild()
            if draining:
                for hook in self.on_draining:
                    hook(worker)

    def half_open(self, worker: Worker) -> None:
        if worker.breaker.half_open():
            logger.warning("circuit breaker of %s worker %s is HALF_OPEN: it answers health probes again",
                           worker.role.value, worker.url)
            self.rebuild()

    def why_none_routable(self, role: WorkerRole) -> str:
        """The 503 message when `routable(role)` is empty: what keeps each worker out."""
        reasons = {w.url: w.unroutable_reason() or "routable" for w in self.workers(role)}
        if not reasons:
            return f"no {role.value} workers registered"
        listed = "; ".join(f"{url}: {why}" for url, why in reasons.items())
        if all(why.startswith("circuit breaker open") for why in reasons.values()):
            return f"all {role.value} workers have open circuit breakers ({listed})"
        if all(why in ("unhealthy", "not answering yet") for why in reasons.values()):
            return f"no healthy {role.value} workers ({listed})"
        return f"no routable {role.value} workers ({listed})"

    def set_dp_size(self, worker: Worker, dp_size: int) -> None:
        if self.config.dp_aware and (dp_size != worker.dp_size or worker.targets[0].dp_rank is None):
            old = worker.targets
            worker.set_dp(dp_size, dp_aware=True)
            for hook in self.on_removed:
                hook(worker, old)
            self.rebuild()

    def record_outcome(self, worker: Worker, ok: bool, unreachable: bool = False) -> None:
        """A real request's outcome, for the circuit breaker; `unreachable`: a transport error."""
        changed = worker.breaker.record_success() if ok else worker.breaker.record_failure()
        if changed:
            logger.warning("circuit breaker of %s worker %s is %s", worker.role.value, worker.url,
                           worker.breaker.state.name)
            self.rebuild()
            if not ok:  # re-read after the open period, when the breaker turns half-open
                self._call_later(self.config.circuit_breaker.timeout_secs, self.rebuild)
                for hook in self.on_breaker_opened:
                    hook(worker, unreachable)

    def rebuild(self) -> None:
        routable: dict[WorkerRole, list[Target]] = {role: [] for role in WorkerRole}
        for worker in self._workers.values():
            if worker.routable():
                routable[worker.role].extend(worker.targets)
        self._routable = routable

    @staticmethod
    def _call_later(delay: float, fn: Callable[[], None]) -> None:
        try:
            asyncio.get_running_loop().call_later(delay, fn)
        except RuntimeError:  # no loop (unit tests): the next rebuild picks the state up
            pass
