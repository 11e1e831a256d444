"""Router configuration: one frozen chain, built once by `cli.py` (or by tests) and never mutated.

Flag names and defaults follow sglang-router where the meaning is the same, so a user can move a
launch command over by changing only the program name.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class WorkerRole(str, enum.Enum):
    """Which side of the router a worker serves. A URL registered on two sides is two workers."""

    REGULAR = "regular"  # colocated engine: prefill and decode in one process
    PREFILL = "prefill"
    DECODE = "decode"


class PolicyName(str, enum.Enum):
    RANDOM = "random"
    ROUND_ROBIN = "round_robin"
    POWER_OF_TWO = "power_of_two"
    CACHE_AWARE = "cache_aware"


class UpstreamClient(str, enum.Enum):
    LEAN = "lean"  # upstream/lean.py: the fast path
    AIOHTTP = "aiohttp"  # upstream/aiohttp_client.py: the obvious path, for comparison


@dataclass(frozen=True)
class WorkerSpec:
    """What it takes to register a worker: from flags, `POST /workers` or a Kubernetes pod."""

    url: str
    role: WorkerRole = WorkerRole.REGULAR
    bootstrap_port: int | None = None  # prefill only; None: the prefill uses its own default

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
        assert self.bootstrap_port is None or self.role is WorkerRole.PREFILL, "bootstrap port on a non-prefill"
        assert self.bootstrap_port is None or 0 < self.bootstrap_port < 65536, self.bootstrap_port


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url:
        raise ValueError("empty worker URL")
    return url if "://" in url else f"http://{url}"


@dataclass(frozen=True)
class RetryConfig:
    max_retries: int = 5  # attempts in all, the first included (sglang-router's meaning)
    initial_backoff_ms: float = 50.0
    max_backoff_ms: float = 30_000.0
    backoff_multiplier: float = 1.5
    jitter_factor: float = 0.2

    def __post_init__(self) -> None:
        assert self.max_retries >= 1 and 0.0 <= self.jitter_factor <= 1.0 and self.backoff_multiplier >= 1.0


@dataclass(frozen=True)
class CircuitBreakerConfig:
    enabled: bool = True
    failure_threshold: int = 10  # consecutive failures that open the breaker
    success_threshold: int = 3  # successes in half-open that close it again
    timeout_secs: float = 60.0  # time open before a trial (half-open)

    def __post_init__(self) -> None:
        assert self.failure_threshold >= 1 and self.success_threshold >= 1 and self.timeout_secs >= 0


@dataclass(frozen=True)
class HealthCheckConfig:
    enabled: bool = True
    failure_threshold: int = 3
    success_threshold: int = 2
    timeout_secs: float = 5.0
    interval_secs: float = 60.0
    endpoint: str = "/health"
    startup_check_interval_secs: float = 1.0  # probe period until a new worker first answers

    def __post_init__(self) -> None:
        assert self.failure_threshold >= 1 and self.success_threshold >= 1
        assert self.interval_secs > 0 and self.timeout_secs > 0 and self.endpoint.startswith("/")


@dataclass(frozen=True)
class CacheAwareConfig:
    cache_threshold: float = 0.3  # prefix-match rate above which the matched worker wins
    balance_abs_threshold: int = 64  # imbalance = max-min > abs AND max > min*rel
    balance_rel_threshold: float = 1.5
    max_tree_size: int = 2**26  # characters kept per worker before LRU eviction

    def __post_init__(self) -> None:
        assert 0.0 <= self.cache_threshold <= 1.0 and self.max_tree_size >= 1


@dataclass(frozen=True)
class DiscoveryConfig:
    enabled: bool = False
    selector: dict[str, str] = field(default_factory=dict)
    prefill_selector: dict[str, str] = field(default_factory=dict)
    decode_selector: dict[str, str] = field(default_factory=dict)
    namespace: str | None = None  # None: all namespaces (needs cluster-wide list/watch)
    port: int = 80
    resync_secs: float = 300.0  # full list at least this often, besides the watch
    api_server: str | None = None  # e.g. a `kubectl proxy` URL; None: in-cluster config, else kubeconfig
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"


@dataclass(frozen=True)
class RouterConfig:
    host: str = "0.0.0.0"
    port: int = 30000
    pd_disaggregation: bool = False
    workers: tuple[WorkerSpec, ...] = ()
    policy: PolicyName = PolicyName.CACHE_AWARE
    prefill_policy: PolicyName | None = None  # None: `policy`
    decode_policy: PolicyName | None = None
    dp_aware: bool = False
    api_key: str | None = field(default=None, repr=False)  # what clients must send; never logged
    # what the router sends the workers (`Authorization: Bearer`) in place of the client's header; never logged
    engine_api_key: str | None = field(default=None, repr=False)
    request_timeout_secs: float = 1800.0
    # on SIGTERM the listener closes and the requests in flight may run on this long (aiohttp's default)
    shutdown_timeout_secs: float = 60.0
    max_payload_size: int = 512 * 1024 * 1024
    # a connection's first request head within this (else closed), and a body (else 408); 0: no limit
    request_read_timeout_secs: float = 60.0
    max_concurrent_requests: int = -1  # -1: unlimited, no queue
    queue_size: int = 100
    queue_timeout_secs: float = 60.0
    retry: RetryConfig = field(default_factory=RetryConfig)
    circuit_breaker: CircuitBreakerConfig = field(default_factory=CircuitBreakerConfig)
    health: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    abort_timeout_secs: float = 5.0
    worker_stall_timeout_secs: float = 15.0  # a worker holding requests that answers no probe this long; 0: off
    upstream_client: UpstreamClient = UpstreamClient.LEAN
    log_level: str = "info"

    def __post_init__(self) -> None:
        roles = {w.role for w in self.workers}
        if self.pd_disaggregation:
            assert WorkerRole.REGULAR not in roles, "--worker-urls cannot be mixed with --pd-disaggregation"
        else:
            assert roles <= {WorkerRole.REGULAR}, "--prefill/--decode need --pd-disaggregation"
        assert self.request_timeout_secs > 0 and self.max_payload_size > 0 and self.queue_size >= 0
        assert self.shutdown_timeout_secs >= 0, "--shutdown-timeout-secs must be >= 0"
        assert self.worker_stall_timeout_secs >= 0
        assert self.request_read_timeout_secs >= 0, "--request-read-timeout-secs must be >= 0"

    def policy_for(self, role: WorkerRole) -> PolicyName:
        if role is WorkerRole.PREFILL and self.prefill_policy is not None:
            return self.prefill_policy
        if role is WorkerRole.DECODE and self.decode_policy is not None:
            return self.decode_policy
        return self.policy

    @property
    def roles(self) -> tuple[WorkerRole, ...]:
        return (WorkerRole.PREFILL, WorkerRole.DECODE) if self.pd_disaggregation else (WorkerRole.REGULAR,)
