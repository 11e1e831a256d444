"""A worker (one engine on one side) and its routing targets (the worker, or one of its DP ranks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from baton.router.circuit_breaker import CircuitBreaker
from baton.router.config import WorkerRole, WorkerSpec


@dataclass(eq=False, slots=True)
class Target:
    """What a policy picks. In DP-aware mode a worker has one target per rank; otherwise one with
    `dp_rank=None`. Compares by identity; `in_flight` is mutated on the hot path only."""

    worker: "Worker"
    dp_rank: int | None
    key: str  # stable name: the tenant in the cache-aware tree, the metrics label
    in_flight: int = 0


@dataclass(eq=False)
class Worker:
    spec: WorkerSpec
    breaker: CircuitBreaker
    source: str = "static"  # static | api | kubernetes: who may remove it
    healthy: bool = False  # set by the health checker (or at once when checks are disabled)
    ready: bool = False  # answered at least once; until then it is probed at the startup interval
    stalled: bool = False  # set by the stall watch: open requests, no answer for --worker-stall-timeout
    draining: bool = False  # it refused a request as draining (SIGTERM, /drain); cleared when /health is 200
    dp_size: int = 1  # set from /get_server_info in DP-aware mode
    health_successes: int = 0  # consecutive, kept by the health checker
    health_failures: int = 0
    targets: list[Target] = field(default_factory=list)  # rebuilt by `set_dp`
    side: str = ""  # role.value as a plain string (metrics labels on the hot path), set below

    def __post_init__(self) -> None:
        self.side = self.spec.role.value
        self.set_dp(self.dp_size, dp_aware=False)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> WorkerRole:
        return self.spec.role

    @property
    def host(self) -> str:
        """The host part of the URL: the prefill's `bootstrap_host`."""
        return urlsplit(self.spec.url).hostname or ""

    @property
    def in_flight(self) -> int:
        return sum(t.in_flight for t in self.targets)

    def routable(self) -> bool:
        return self.healthy and not self.stalled and not self.draining and self.breaker.allows()

    def unroutable_reason(self) -> str | None:
        """Why no request may go to this worker now (None: it may), in words for error messages."""
        if not self.ready:
            return "not answering yet"
        if not self.healthy:
            return "unhealthy"
        if self.stalled:
            return "stalled (stopped answering while holding requests)"
        if self.draining:
            return "draining (finishing its requests before it stops)"
        if not self.breaker.allows():
            return (f"circuit breaker open for {self.breaker.opens_for():.0f}s more, "
                    "or until it answers a health probe after being down")
        return None

    def set_dp(self, dp_size: int, dp_aware: bool) -> None:
        assert dp_size >= 1, dp_size
        self.dp_size = dp_size
        if dp_aware:
            self.targets = [Target(self, rank, f"{self.url}@{rank}") for rank in range(dp_size)]
        else:
            self.targets = [Target(self, None, self.url)]

    def describe(self) -> dict:
        return {
            "url": self.url,
            "role": self.role.value,
            "bootstrap_port": self.spec.bootstrap_port,
            "source": self.source,
            "healthy": self.healthy,
            "stalled": self.stalled,
            "draining": self.draining,
            "circuit_breaker": self.breaker.state.name.lower(),
            "dp_size": self.dp_size,
            "in_flight": self.in_flight,
        }
